//! The reported figures and how they are printed.

/// One reported figure.
#[derive(Debug, Clone, PartialEq)]
pub struct Figure {
    /// Name, e.g. `bytes_per_qp`.
    pub name: std::borrow::Cow<'static, str>,
    /// Value.
    pub value: f64,
    /// Unit, e.g. `B` or `s` (empty for counts).
    pub unit: &'static str,
}

pub(crate) fn fig(name: &'static str, value: f64, unit: &'static str) -> Figure {
    Figure {
        name: name.into(),
        value,
        unit,
    }
}

/// Prints `figures` as `name value unit` lines or as one JSON object.
pub fn print_figures(figures: &[Figure], json: bool) {
    if json {
        let body: Vec<String> = figures
            .iter()
            .map(|f| format!("\"{}\": {}", f.name, json_num(f.value)))
            .collect();
        println!("{{{}}}", body.join(", "));
    } else {
        for f in figures {
            println!("{:<28} {:>16} {}", f.name, trim_num(f.value), f.unit);
        }
    }
}

fn json_num(v: f64) -> String {
    if v.is_finite() {
        trim_num(v)
    } else {
        "null".to_string()
    }
}

fn trim_num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}
