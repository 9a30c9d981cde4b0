/*
 * The checks every C test program uses: CHECK prints one "ok" / "not ok" line per check and
 * counts failures (the program's exit status reports them); REQUIRE stops the program when a
 * check that later ones depend on fails.
 */
#ifndef SOFTVERBS_TEST_CHECK_H
#define SOFTVERBS_TEST_CHECK_H

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

static int failures;

#define CHECK(cond, ...) check_(!!(cond), __LINE__, __VA_ARGS__)
#define REQUIRE(cond, ...)                                                      \
	do {                                                                    \
		if (!check_(!!(cond), __LINE__, __VA_ARGS__)) {                 \
			printf("stopping\n");                                   \
			exit(1);                                                \
		}                                                               \
	} while (0)

static int check_(int ok, int line, const char *fmt, ...)
{
	va_list ap;
	if (ok) {
		printf("ok - ");
	} else {
		printf("not ok (line %d, errno %d) - ", line, errno);
		failures++;
	}
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	return ok;
}

#endif
