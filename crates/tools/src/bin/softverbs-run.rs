//! `softverbs-run CMD [ARGS]`: runs a program on softverbs' `libibverbs.so.1` and
//! `librdmacm.so.1`, as `torsocks` runs one through Tor (see [`MANUAL`]).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

use clap::Parser;
use softverbs_tools::run::{self, RDMACM};

/// What `--help` prints: a manual page.
const MANUAL: &str = "\
NAME
    softverbs-run - run a program on the softverbs software RDMA device

SYNOPSIS
    softverbs-run [-L DIR] [-v] CMD [ARGS...]
    softverbs-run [-L DIR] --print-lib-dir
    softverbs-run --help | --version

DESCRIPTION
    Runs CMD with ARGS so that it loads softverbs' libibverbs.so.1 and librdmacm.so.1 instead
    of the system's (rdma-core), as torsocks does for Tor: the libraries' directory is put first
    in LD_LIBRARY_PATH for CMD and what it starts, and for nothing else. Any program built
    against <infiniband/verbs.h> or <rdma/rdma_cma.h> (ibverbs-utils, perftest, rdmacm-utils,
    libfabric, ...) then sees the softverbs devices (sv_lo, sv_eth0, ...), with no RDMA NIC, no
    kernel module and no root. (UCX and Open MPI need more than the libraries: the README's
    \"Running C programs\" says what.)

    softverbs-run replaces itself with CMD (exec): signals, the exit status and the terminal
    are CMD's own.

    The libraries are looked for, in this order, in: the directory of -L; $SOFTVERBS_LIB_DIR;
    PREFIX/lib/softverbs when softverbs-run is PREFIX/bin/softverbs-run (as scripts/install
    lays it out); the directory of softverbs-run itself (a cargo target directory where
    crates/rdmacm/build-lib.sh linked the libraries); and the default prefix of
    scripts/install, $XDG_DATA_HOME/softverbs or ~/.local/share/softverbs. The first directory
    holding libibverbs.so.1 is used; a directory named by -L or $SOFTVERBS_LIB_DIR must hold it.

OPTIONS
    -L, --lib-dir DIR
        Use the libraries in DIR.
    --print-lib-dir
        Print the directory found and exit, e.g. for LD_LIBRARY_PATH=$(softverbs-run
        --print-lib-dir) in a script.
    -v, --verbose
        Say on standard error which directory is used.
    -h, --help
        Print this manual and exit.
    -V, --version
        Print the version and exit.

    Options are read up to CMD: everything after it is CMD's.

ENVIRONMENT
    SOFTVERBS_LIB_DIR
        The libraries' directory, when -L is not given.
    LD_LIBRARY_PATH
        Kept for CMD, after the libraries' directory.
    XDG_DATA_HOME, HOME
        Where the default prefix is.
    SOFTVERBS_*
        Passed to CMD unchanged; they configure the device (see the README: SOFTVERBS_INTERFACES,
        SOFTVERBS_SHM, ...).

EXIT STATUS
    CMD's exit status; 125 if softverbs-run itself fails (no libraries, a bad option), 126 if
    CMD cannot be run, 127 if CMD is not found.

NOTES
    The dynamic loader ignores LD_LIBRARY_PATH for set-user-ID and set-group-ID programs, and
    a program linked with an old-style DT_RPATH naming another libibverbs finds that one
    first; such programs keep the system's libraries.

EXAMPLES
    softverbs-run ibv_devices
    softverbs-run ibv_devinfo -v -d sv_lo
    softverbs-run ib_write_bw -d sv_lo -x 0 & softverbs-run ib_write_bw -d sv_lo -x 0 127.0.0.1
    softverbs-run rping -s -a 127.0.0.1 -v
    softverbs-run -L target/release ucx_info -d

SEE ALSO
    scripts/install (installs the tools and libraries in a private prefix), torsocks(1),
    ld.so(8)
";

#[derive(Parser, Debug)]
#[command(name = "softverbs-run", version, override_help = MANUAL)]
struct Args {
    /// The libraries' directory.
    #[arg(short = 'L', long, value_name = "DIR")]
    lib_dir: Option<PathBuf>,

    /// Print the libraries' directory and exit.
    #[arg(long, conflicts_with = "command")]
    print_lib_dir: bool,

    /// Say which directory is used.
    #[arg(short, long)]
    verbose: bool,

    /// The program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// softverbs-run's own failures, as env(1) and nice(1) report theirs.
const OWN_FAILURE: u8 = 125;

fn fail(msg: &str, code: u8) -> ExitCode {
    eprintln!("softverbs-run: {msg}");
    ExitCode::from(code)
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => match e.kind() {
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => e.exit(),
            _ => {
                let _ = e.print();
                return ExitCode::from(OWN_FAILURE);
            }
        },
    };
    if args.command.is_empty() && !args.print_lib_dir {
        return fail(
            "no command given (softverbs-run --help shows the manual)",
            OWN_FAILURE,
        );
    }
    let env_dir = std::env::var_os("SOFTVERBS_LIB_DIR");
    let explicit =
        usize::from(args.lib_dir.is_some()) + usize::from(env_dir.as_ref().is_some_and(|d| !d.is_empty()));
    let exe = std::env::current_exe().ok().and_then(|e| e.canonicalize().ok());
    let prefix = run::default_prefix(std::env::var_os("XDG_DATA_HOME"), std::env::var_os("HOME"));
    let dirs = run::candidates(args.lib_dir, env_dir, exe, prefix);
    let dir = match run::find_lib_dir(&dirs, explicit) {
        Ok(d) => d.canonicalize().unwrap_or(d),
        Err(e) => return fail(&e, OWN_FAILURE),
    };
    if args.print_lib_dir {
        println!("{}", dir.display());
        return ExitCode::SUCCESS;
    }
    if args.verbose {
        eprintln!("softverbs-run: libraries from {}", dir.display());
        if !dir.join(RDMACM).is_file() {
            eprintln!(
                "softverbs-run: {} has no {RDMACM}: programs that use librdmacm load the system's",
                dir.display()
            );
        }
    }
    let path = run::library_path(&dir, std::env::var_os("LD_LIBRARY_PATH"));
    let err = Command::new(&args.command[0])
        .args(&args.command[1..])
        .env("LD_LIBRARY_PATH", path)
        .exec();
    let name = args.command[0].to_string_lossy();
    let code = if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    };
    fail(&format!("{name}: {err}"), code)
}
