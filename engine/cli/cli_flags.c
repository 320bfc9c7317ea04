#define _POSIX_C_SOURCE 200809L
/* cli_flags.c: see cli_flags.h. */
#include "engine/cli/cli_flags.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *cli_program = "moe";

int cli_usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", cli_program);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see %s --help)\n", cli_program);
    va_end(ap);
    return 2;
}

/* strtol and friends skip leading spaces and take a '+': a value must
 * start with a digit, or a '.' and a digit (real), after a '-' where
 * negative values parse. */
static bool starts_number(const char *s, bool sign, bool real) {
    if (sign && s[0] == '-') s++;
    return isdigit((unsigned char)s[0]) || (real && s[0] == '.' && isdigit((unsigned char)s[1]));
}

static int parse_int(int64_t *out, const char *flag, const char *s) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || !starts_number(s, true, false) || *end) return cli_usage_error("%s '%s': expected an integer", flag, s);
    *out = v;
    return 0;
}

/* Decimal only (strtod also reads hex: "0x10" is not a learning rate).
 * A value too small for a normal double is taken as strtod rounds it; one
 * that rounds to 0 or past the largest double is refused, quoting the text
 * (a later check would quote the 0, or a --temperature turn greedy). */
static int parse_real(double *out, const char *flag, const char *s) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if ((errno && errno != ERANGE) || !starts_number(s, true, true) || *end || strpbrk(s, "xX") != NULL)
        return cli_usage_error("%s '%s': expected a number", flag, s);
    if (errno == ERANGE && (v == 0.0 || !isfinite(v)))
        return cli_usage_error("%s '%s': out of range: a double rounds it to %s", flag, s,
                               v == 0.0 ? "0" : "infinity");
    *out = v;
    return 0;
}

static int parse_seed(uint64_t *out, const char *flag, const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || !starts_number(s, false, false) || *end)
        return cli_usage_error("%s '%s': expected a non-negative integer", flag, s);
    *out = v;
    return 0;
}

static int set_flag(void *options, const cli_flag *f, const char *value) {
    void *field = (char *)options + f->offset;
    int64_t i = 0;
    switch (f->kind) {
    case CLI_STRING: *(const char **)field = value; return 0;
    case CLI_INT: return parse_int(field, f->name, value);
    case CLI_REAL: return parse_real(field, f->name, value);
    case CLI_SEED: return parse_seed(field, f->name, value);
    case CLI_THREADS:
        if (parse_int(&i, f->name, value)) return 2;
        if (i < 0 || i > INT_MAX)
            return cli_usage_error("%s %s: expected 0 (OpenMP's default) or a thread count", f->name, value);
        *(int *)field = (int)i;
        return 0;
    case CLI_SMALL:
        if (parse_int(&i, f->name, value)) return 2;
        if (i < INT_MIN || i > INT_MAX) return cli_usage_error("%s %s: out of range", f->name, value);
        *(int *)field = (int)i;
        return 0;
    case CLI_SWITCH: *(bool *)field = true; return 0;
    case CLI_PARSED:
        if (f->parse(field, value) != MOE_OK) return cli_usage_error("%s", moe_last_error());
        return 0;
    }
    return 2;
}

int cli_parse_args(void *options, const cli_flag *flags, size_t n_flags, int argc, char **argv) {
    const char *took_value = NULL; /* the flag before arg, when arg follows its value */
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a], *after = took_value;
        took_value = NULL;
        if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) return -1;
        const char *eq = strchr(arg, '=');
        const size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        const cli_flag *f = NULL;
        for (size_t i = 0; i < n_flags; i++)
            if (strlen(flags[i].name) == name_len && strncmp(flags[i].name, arg, name_len) == 0) f = &flags[i];
        /* A word after a flag's value is most often more of that value:
         * words the shell split, or the matches of a glob it expanded. */
        if (!f && after && arg[0] != '-')
            return cli_usage_error("unexpected '%s' after %s %s: quote a value that has spaces%s", arg, after,
                                   argv[a - 1],
                                   strstr(after, "data") ? ", and a glob, for the shell expands it (--data 'dir/*.bin')"
                                                         : "");
        if (!f) return cli_usage_error("unknown option '%s'", arg);
        const char *value;
        if (f->kind == CLI_SWITCH) {
            if (eq) return cli_usage_error("%s takes no value (got '%s')", f->name, eq + 1);
            value = NULL;
        } else if (eq) {
            value = eq + 1;
        } else if (a + 1 < argc) {
            value = argv[++a];
            took_value = f->name;
        } else {
            return cli_usage_error("%s needs a value", f->name);
        }
        int rc = set_flag(options, f, value);
        if (rc) return rc;
    }
    return 0;
}

/* Help into a pipe whose reader stopped early (| head) was read as far as
 * wanted: no failure there, unlike a run's lines. */
static int help_written(void) {
    struct stat sb;
    const bool piped = fstat(STDOUT_FILENO, &sb) == 0 && S_ISFIFO(sb.st_mode);
    if (piped && (fflush(stdout) != 0 || ferror(stdout))) return 0;
    return cli_stdout_written();
}

int cli_start(const char *program, void *options, const cli_flag *flags, size_t n_flags, int argc, char **argv,
              void (*print_help)(void), moe_status (*validate)(const void *options)) {
    /* Line by line into a pipe or a log too: a long run's lines show as they come. */
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* A pipe whose reader has gone (| head) fails the write (EPIPE) rather
     * than end the program unseen, and with no checkpoint of a training
     * run: the program goes on, and cli_stdout_written says so at its end. */
    signal(SIGPIPE, SIG_IGN);
    cli_program = program;
    const int rc = cli_parse_args(options, flags, n_flags, argc, argv);
    if (rc < 0) {
        print_help();
        return help_written();
    }
    if (rc) return rc;
    if (validate(options) != MOE_OK) return cli_usage_error("%s", moe_last_error());
    return -1;
}

/* stdout first: where one terminal or log shows both streams, a message
 * lands after the lines printed before it. */
void cli_warning(const char *message) {
    fflush(stdout);
    fprintf(stderr, "%s: warning: %s\n", cli_program, message);
}

int cli_stdout_written(void) {
    errno = 0;
    const bool flushed = fflush(stdout) == 0;
    if (flushed && !ferror(stdout)) return 0;
    /* errno is the flush's; an earlier failed write left only the flag. */
    fprintf(stderr, "%s: writing to stdout failed%s%s\n", cli_program, flushed ? "" : ": ",
            flushed ? " (some output was lost)" : strerror(errno));
    return 1;
}

int cli_run_failed(moe_status status, const char *rank) {
    fflush(stdout);
    if (rank)
        fprintf(stderr, "%s: rank %s: %s: %s\n", cli_program, rank, moe_status_string(status), moe_last_error());
    else
        fprintf(stderr, "%s: %s: %s\n", cli_program, moe_status_string(status), moe_last_error());
    /* A setting this build or machine cannot run fails again on retry. */
    return status == MOE_ERR_CONFIG || status == MOE_ERR_UNSUPPORTED ? 2 : 1;
}
