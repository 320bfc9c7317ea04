/* data.h: token streams for training and evaluation (DESIGN.md 6).
 *
 * A source is one stream of n tokens, from one of:
 *  - a raw file read at byte level (vocab 256, each byte a token),
 *  - a glob of llm.c token shards (uint16 or uint32 tokens), concatenated in
 *    sorted name order,
 *  - tokens in memory (the synthetic corpus, tests).
 *
 * Batches follow llm.c: a batch of R rows of T reads R*T + 1 consecutive
 * tokens starting at the current position p; row r takes inputs
 * tokens[p + r*T .. p + r*T + T - 1] and targets one further, tokens[p + r*T
 * + 1 .. p + r*T + T]. The position then advances by R*T, so the next batch
 * begins where this one's inputs ended (its first input is this batch's last
 * target). When fewer than R*T + 1 tokens remain from p, the tail is skipped:
 * the batch is read from 0 and the epoch count goes up by one. A row never
 * wraps around the end of the stream; rows do cross shard boundaries.
 *
 * Shuffling permutes the R*T-token chunks of an epoch: chunk c covers tokens
 * [c*R*T, c*R*T + R*T] (its last token only as a target), the epoch has
 * floor((n - 1) / (R*T)) chunks, and epoch e reads them in an order that
 * depends only on (seed, e) and that number of chunks: a stream of another
 * length or another batch shape is read in another order. The position then
 * counts tokens consumed in the epoch, in units of whole chunks, so the
 * batch shape must stay the same for a whole epoch.
 *
 * Data parallelism: every rank asks for the same global batch of R*B rows at
 * the same position and reads only its own rows first_row .. first_row + B -
 * 1; all ranks advance by the whole global batch. One rank reading all R*B
 * rows gets exactly the union of what R ranks read.
 *
 * Shard tokens are checked against vocab_size as they are read (a whole-file
 * scan at open would cost minutes on large corpora), so a bad token is
 * reported by the next_batch that would have used it, naming the shard, the
 * token's index in it and its value. Headers, counts and sizes are checked
 * at open. Offsets are 64-bit throughout. */
#ifndef MOE_ENGINE_DATA_H
#define MOE_ENGINE_DATA_H

#include <stdbool.h>
#include <stdint.h>

#include "moe.h"

/* llm.c's token shards (data_common.py write_datafile): a header of 256
 * little-endian int32 (magic, version, token count, zeros), then the tokens
 * little-endian, as GPT-2's uint16 (magic and version below) or, for a
 * vocabulary past 65536 (Llama 3's, Qwen's), as uint32 (the 32 ones). */
#define MOE_SHARD_MAGIC 20240520
#define MOE_SHARD_VERSION 1
#define MOE_SHARD32_MAGIC 20240801
#define MOE_SHARD32_VERSION 7
#define MOE_SHARD_HEADER_BYTES 1024
#define MOE_BYTE_VOCAB_SIZE 256

/* Whether a little-endian int32 at a file's start is a shard's magic. */
bool moe_data_is_shard_magic(int32_t magic);

typedef struct moe_data moe_data;

/* Where a source will read next: enough to resume a run exactly. In order
 * (no shuffle) token is the stream offset of the next batch; with shuffle it
 * is the number of tokens of this epoch already read. */
typedef struct moe_data_position {
    int64_t token;
    int64_t epoch; /* in [0, MOE_DATA_EPOCH_MAX] */
} moe_data_position;

/* The last epoch a source counts to: moe_data_next_batch refuses to start
 * another after it rather than let the count overflow, and a position past
 * it (a corrupt checkpoint) is refused. */
#define MOE_DATA_EPOCH_MAX (INT64_MAX - 1)

/* Any file as a stream of bytes, vocab 256. An empty file is refused; one
 * shorter than a batch is refused by moe_data_next_batch, naming the file. */
moe_status moe_data_open_bytes(moe_data **data, const char *path);

/* The shards that glob(3) matches for pattern, in sorted order, as one
 * stream; a regular file named pattern itself is the one shard. vocab_size
 * comes from the model config; a token at or above it is an error when
 * read. */
moe_status moe_data_open_shards(moe_data **data, const char *pattern, int64_t vocab_size);

/* A copy of tokens [n], each in [0, vocab_size). name appears in errors. */
moe_status moe_data_from_tokens(moe_data **data, const int32_t *tokens, int64_t n,
                                int64_t vocab_size, const char *name);

void moe_data_close(moe_data *data);

int64_t moe_data_vocab_size(const moe_data *data);
int64_t moe_data_token_count(const moe_data *data);

/* Narrows the stream to its tokens [begin, end) (a held-out split: the
 * training reader before it, the evaluation one after): positions, epochs
 * and shuffling then count within them, and moe_data_token_count is end -
 * begin. The position goes back to the start of epoch 0. */
moe_status moe_data_restrict(moe_data *data, int64_t begin, int64_t end);

/* Turns shuffling on (with seed) or off. Either way the position goes back
 * to the start of epoch 0; moe_data_set_position can move it after. */
void moe_data_set_shuffle(moe_data *data, int shuffle, uint64_t seed);

moe_data_position moe_data_get_position(const moe_data *data);

/* Refuses an epoch outside [0, MOE_DATA_EPOCH_MAX] or a token outside
 * [0, n]. */
moe_status moe_data_set_position(moe_data *data, moe_data_position position);

/* Reads rows first_row .. first_row + n_rows - 1 of the global batch of
 * global_rows rows of T tokens at the current position, then advances the
 * position by global_rows * T (see the top of this file). Starting an epoch
 * past MOE_DATA_EPOCH_MAX is MOE_ERR_STATE, the position unchanged.
 * inputs [n_rows, T], targets [n_rows, T]. */
moe_status moe_data_next_batch(moe_data *data, int32_t *inputs, int32_t *targets,
                               int64_t global_rows, int64_t first_row, int64_t n_rows, int64_t T);

/* Writes tokens [n] as an llm.c shard of token_bytes-byte tokens (2:
 * uint16, 4: uint32) at path, atomically (the file that was there survives
 * any failure). Refuses a token outside [0, 65535] in a uint16 shard, a
 * negative one, and n >= 2^31 (the header's count is an int32), before
 * touching path. */
moe_status moe_data_write_shard(const char *path, const int32_t *tokens, int64_t n, int token_bytes);

#endif /* MOE_ENGINE_DATA_H */
