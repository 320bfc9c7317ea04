/* cli_flags.h: the flag parsing the programs share. A program lists its
 * flags in a table, each naming a field of its options struct and how the
 * field is read; the values land there as "--flag value" or "--flag=value".
 * Exit status convention: 2 for a bad flag or a refused combination, 1 for
 * a failed run (cli_run_failed). */
#ifndef MOE_ENGINE_CLI_CLI_FLAGS_H
#define MOE_ENGINE_CLI_CLI_FLAGS_H

#include <stddef.h>

#include "moe.h"

typedef enum cli_kind {
    CLI_STRING,  /* const char *: the argument itself */
    CLI_INT,     /* int64_t */
    CLI_REAL,    /* double, finite */
    CLI_SEED,    /* uint64_t */
    CLI_THREADS, /* int: 0 (OpenMP's default) or a count; the program's validation bounds it */
    CLI_SMALL,   /* int; the program's validation checks the range */
    CLI_SWITCH,  /* bool, set by the flag alone */
    CLI_PARSED,  /* parse (a library's parser, whose error names the flag) */
} cli_kind;

typedef struct cli_flag {
    const char *name;
    cli_kind kind;
    size_t offset; /* of the field in the options struct */
    moe_status (*parse)(void *field, const char *value); /* CLI_PARSED only */
} cli_flag;

/* The program's name, for messages; set by main. */
extern const char *cli_program;

/* Prints "PROGRAM: message (see PROGRAM --help)" on stderr; returns 2. */
int cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Fills options from argv; 0 on success, 2 on a bad flag (after saying
 * why), -1 when -h or --help asks for the help text. */
int cli_parse_args(void *options, const cli_flag *flags, size_t n_flags, int argc, char **argv);

/* The start of every program's main, so that all of them take flags, show
 * their help and refuse bad values alike: ignores SIGPIPE (a closed stdout
 * is then a failed write, for cli_stdout_written), names the program,
 * fills options (at their defaults already) from argv and validates them.
 * Returns -1 when the program should go ahead, else its exit status: 0
 * after print_help (1 when stdout could not take it), 2 for a bad flag or
 * a combination validate refuses. */
int cli_start(const char *program, void *options, const cli_flag *flags, size_t n_flags, int argc, char **argv,
              void (*print_help)(void), moe_status (*validate)(const void *options));

/* Prints "PROGRAM: warning: message" on stderr. */
void cli_warning(const char *message);

/* After a run that succeeded: 0 when everything printed reached stdout,
 * else 1 with the reason on stderr (a full disk, a closed pipe: what the
 * program printed is lost, so it did not do its job). */
int cli_stdout_written(void);

/* Prints "PROGRAM: [rank RANK: ]STATUS: last error" on stderr, after stdout
 * as cli_warning (rank NULL: one process); returns the exit status: 2 for
 * MOE_ERR_CONFIG (what was asked for can never run: flags that exclude
 * each other, a config.json, an --out holding another run), 1 for any
 * other failure (a file, a device, a peer: another try may succeed). */
int cli_run_failed(moe_status status, const char *rank);

#endif /* MOE_ENGINE_CLI_CLI_FLAGS_H */
