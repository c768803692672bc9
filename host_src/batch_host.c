/* The host bookkeeping of propose / propose_batch, after_verify_batch and prefill_batch's catch-up, compiled: the
 * checks, the KV-block reservation, the per-step slab staging and the counter updates that speculative/base.py
 * and prefill.py otherwise run in NumPy (their twin: the same state, byte for byte, after every call;
 * tests/test_batch_host.py).
 *
 * Everything lives in arrays Python owns (speculative/batch_host.py points a BatchPlan at them): the KV cache's
 * mirror (int64 counters cols[row][ncols], int32 block tables tables[row][width]), its free-block stack and
 * used flags, the proposer's drafts [row][max_drafts], the batch's mirror rows idx[B], per-call int64 buffers
 * of max_batch entries, and the pinned stage the chain copies in (slabs of `stride` bytes from meta_off, step i's
 * W slabs at meta_off + i * W * stride; a slab is pos i64 word 0, slot word 1, seq_len word 2, int32 table from
 * table_off).
 *
 * A call either succeeds whole or returns a negative code before it changes anything: the caller then runs its
 * NumPy path, which names the problem (bad id, hole, capacity) or handles the rare case (a table to widen, more
 * than one block for a sequence in one call). */
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t *cols;            /* [rows][ncols] */
    int32_t *tables;          /* [rows][width] */
    int32_t *stack;           /* free blocks; the next one handed out at nfree - 1 */
    uint8_t *used;            /* [num_blocks] 1 = handed out */
    int32_t *drafts;          /* [rows][max_drafts] */
    const int64_t *idx;       /* [B] the batch's mirror rows */
    int64_t *tokens, *positions, *rows0, *counts, *listed;   /* per call, [max_batch] each */
    uint8_t *stage;
    const uint8_t *pad_slab;  /* [stride] */
    uint8_t *pre_stage;       /* prefill_in's pinned twin: slots i64 [P] | positions u32 [P] | ids i32 [P + 1] */
    int64_t ncols, width, max_drafts, nfree, num_blocks;
    int64_t c_rows, c_nblocks, c_off, c_run0, c_drafted, c_last;
    int64_t block_size, max_seq_len, vocab, drafter_context, refeed;
    int64_t meta_off, stride, table_off, pre_rows;
} BatchPlan;

enum { FALL_BACK_INPUT = -1, FALL_BACK_ROOM = -2, FALL_BACK_STATE = -3 };

static int64_t blocks_for(int64_t rows, int64_t bs) { return (rows + bs - 1) / bs; }

/* Sequence s of a call that adds k rows at its position (positions[s] when `given`, else its next one): the
 * checks the NumPy path makes (token id, position past max_seq_len, the no-hole rule; as uint64 a negative id is
 * huge), then positions[s] and rows0[s] set. Returns the blocks it needs more (0 or 1), or a negative code (more
 * than one, or a table the mirror's width cannot hold: the NumPy path's cases). */
static int64_t admit(BatchPlan *p, int64_t s, int64_t k, int64_t given)
{
    const int64_t *c = p->cols + p->idx[s] * p->ncols;
    const int64_t r0 = c[p->c_rows], nxt = c[p->c_off] + r0;
    const int64_t pos = given ? p->positions[s] : nxt;
    if ((uint64_t)p->tokens[s] >= (uint64_t)p->vocab || pos > p->max_seq_len - k)
        return FALL_BACK_INPUT;
    if (p->drafter_context ? pos != nxt : pos < nxt)
        return FALL_BACK_INPUT;
    const int64_t need = blocks_for(r0 + k, p->block_size) - c[p->c_nblocks];
    if (need > 1 || c[p->c_nblocks] + need > p->width)
        return FALL_BACK_ROOM;
    p->positions[s] = pos;
    p->rows0[s] = r0;
    return need;
}

/* One block more at the end of the table of the sequence at mirror row `row`: the j-th this call hands out, in
 * the order one-at-a-time reserves in batch order would take them (nfree follows once the call is done). */
static void take_block(BatchPlan *p, int64_t row, int64_t j)
{
    int64_t *c = p->cols + row * p->ncols;
    const int32_t b = p->stack[p->nfree - 1 - j];
    p->used[b] = 1;
    p->tables[row * p->width + c[p->c_nblocks]] = b;
    c[p->c_nblocks] += 1;
}

/* propose_batch before its chain: admit the B sequences, reserve the blocks they need, and stage step 0's token
 * ids and every step's slab (pad rows B..W-1: id 0 and pad_slab). positions[] is read when `given`;
 * positions[] and rows0[] hold what the call uses on return. Returns the blocks handed out, or a negative code. */
int64_t mtp_batch_stage(BatchPlan *p, int64_t B, int64_t k, int64_t W, int64_t given)
{
    const int64_t bs = p->block_size;
    int64_t most = 1, grow = 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t need = admit(p, s, k, given);
        if (need < 0)
            return need;
        const int64_t nb = p->cols[p->idx[s] * p->ncols + p->c_nblocks] + need;
        grow += need;
        most = nb > most ? nb : most;
    }
    if (grow > p->nfree || p->table_off + 4 * most > p->stride)
        return FALL_BACK_ROOM;
    for (int64_t s = 0, j = 0; s < B && j < grow; s++) {
        const int64_t row = p->idx[s];
        if (blocks_for(p->rows0[s] + k, bs) > p->cols[row * p->ncols + p->c_nblocks])
            take_block(p, row, j++);
    }
    p->nfree -= grow;
    int32_t *ids = (int32_t *)p->stage;   /* step 0's token ids, pad rows 0 */
    for (int64_t s = 0; s < W; s++)
        ids[s] = s < B ? (int32_t)p->tokens[s] : 0;
    uint8_t *slabs = p->stage + p->meta_off;
    for (int64_t s = 0; s < B; s++) {
        const int32_t *table = p->tables + p->idx[s] * p->width;
        for (int64_t i = 0; i < k; i++) {
            uint8_t *slab = slabs + (i * W + s) * p->stride;
            int64_t *w = (int64_t *)slab;
            const int64_t row = p->rows0[s] + i;
            w[0] = p->positions[s] + i;
            w[1] = (int64_t)table[row / bs] * bs + row % bs;
            w[2] = row + 1;
            memcpy(slab + p->table_off, table, 4 * (size_t)most);
        }
    }
    for (int64_t i = 0; i < k; i++)
        for (int64_t s = B; s < W; s++)
            memcpy(slabs + (i * W + s) * p->stride, p->pad_slab, (size_t)p->stride);
    return grow;
}

/* prefill_batch's catch-up: one row per sequence (counts[s], the call's row counts, must all be 1), tokens[s] at
 * positions[s] when `given`, else at its next position (the rows after_verify_batch dropped, from the target).
 * Admits each, reserves the blocks, writes the rows' slots, positions and ids into the prefill stage (ids[0] is
 * never read) and every row count one up. rows0[] holds the counts before. Returns how many sequences start a
 * new run of positions (their batch indices in listed[]), or a negative code. */
int64_t mtp_batch_catch_up(BatchPlan *p, int64_t B, int64_t given)
{
    const int64_t bs = p->block_size;
    int64_t grow = 0;
    if (B > p->pre_rows)
        return FALL_BACK_ROOM;
    for (int64_t s = 0; s < B; s++) {
        const int64_t need = p->counts[s] != 1 ? FALL_BACK_INPUT : admit(p, s, 1, given);
        if (need < 0)
            return need;
        grow += need;
    }
    if (grow > p->nfree)
        return FALL_BACK_ROOM;
    int64_t *slots = (int64_t *)p->pre_stage;
    uint32_t *poss = (uint32_t *)(p->pre_stage + 8 * p->pre_rows);
    int32_t *ids = (int32_t *)(p->pre_stage + 12 * p->pre_rows);
    int64_t n = 0;
    ids[0] = 0;
    for (int64_t s = 0, j = 0; s < B; s++) {
        const int64_t row = p->idx[s], r0 = p->rows0[s];
        int64_t *c = p->cols + row * p->ncols;
        if (blocks_for(r0 + 1, bs) > c[p->c_nblocks])
            take_block(p, row, j++);
        slots[s] = (int64_t)p->tables[row * p->width + r0 / bs] * bs + r0 % bs;
        poss[s] = (uint32_t)p->positions[s];
        ids[s + 1] = (int32_t)p->tokens[s];
        c[p->c_rows] = r0 + 1;
        if (r0 == 0 || p->positions[s] != c[p->c_off] + r0)
            p->listed[n++] = s;
    }
    p->nfree -= grow;
    return n;
}

/* propose_batch after its chain: every sequence now holds rows0 + k rows, drafted counts[s] of them (all k when
 * `kept_all`), its last drafts are toks[s] (int32 [B][k]; NULL: device results, none kept). Returns how many
 * sequences start a new run of positions (their batch indices in listed[]: the caller extends their runs). */
int64_t mtp_batch_finish(BatchPlan *p, int64_t B, int64_t k, int64_t kept_all, const int32_t *toks)
{
    int64_t n = 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t row = p->idx[s], r0 = p->rows0[s];
        int64_t *c = p->cols + row * p->ncols;
        const int64_t kept = kept_all ? k : p->counts[s];
        c[p->c_rows] = r0 + k;
        c[p->c_drafted] = kept;
        c[p->c_last] = toks ? kept : 0;
        if (toks)
            memcpy(p->drafts + row * p->max_drafts, toks + s * k, 4 * (size_t)k);
        if (r0 == 0 || (!p->drafter_context && p->positions[s] != c[p->c_off] + r0))
            p->listed[n++] = s;
    }
    return n;
}

/* after_verify_batch: counts[s] of sequence s's drafts were accepted; trim the rows the rule drops and give back
 * a block that empties. rows0[s] holds each sequence's row count on return. Returns how many sequences lost
 * their last run of positions (indices in listed[]: the caller cuts their runs), or a negative code (a count
 * outside [0, drafted], more than one block emptied, a block not handed out). */
int64_t mtp_batch_trim(BatchPlan *p, int64_t B)
{
    const int64_t bs = p->block_size;
    int64_t freed = 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t row = p->idx[s];
        const int64_t *c = p->cols + row * p->ncols;
        const int64_t a = p->counts[s], d = c[p->c_drafted];
        if ((uint64_t)a > (uint64_t)d)
            return FALL_BACK_INPUT;
        const int64_t rows = c[p->c_rows] - (p->refeed ? d - (a < 1 ? a : 1) : d - a);
        const int64_t drop = c[p->c_nblocks] - blocks_for(rows, bs);
        if (drop > 1)
            return FALL_BACK_ROOM;
        if (drop == 1 && !p->used[p->tables[row * p->width + c[p->c_nblocks] - 1]])
            return FALL_BACK_STATE;
        freed += drop;
        p->rows0[s] = rows;
    }
    if (p->nfree + freed > p->num_blocks)
        return FALL_BACK_STATE;
    int64_t n = 0;
    for (int64_t s = 0; s < B; s++) {
        const int64_t row = p->idx[s], rows = p->rows0[s];
        int64_t *c = p->cols + row * p->ncols;
        c[p->c_rows] = rows;
        c[p->c_drafted] = 0;
        if (c[p->c_nblocks] > blocks_for(rows, bs)) {
            const int32_t b = p->tables[row * p->width + --c[p->c_nblocks]];
            p->used[b] = 0;
            p->stack[p->nfree++] = b;
        }
        if (rows <= c[p->c_run0])
            p->listed[n++] = s;
    }
    return n;
}
