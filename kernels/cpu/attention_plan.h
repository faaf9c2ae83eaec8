// Splits one paged-attention call into work items for the thread pool.
//
// Items are (sequence, kv heads, query-token tile, key range).  Long contexts are split
// along the keys when there would otherwise be too few items to keep every thread busy
// (a single long decode has only num_kv_heads items); the splits are merged after.
// Items are sorted by decreasing cost and handed out dynamically, so a mixed batch of
// one long prefill and many short decodes still balances.
#pragma once

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace pagedserve_cpu {

struct AttnPlan {
  std::vector<AttnWork> work;
  std::vector<AttnMerge> merges;
  int64_t partial_rows = 0;
};

struct AttnPlanConfig {
  int tile_rows = 64;          // query rows (tokens x group) per prefill item
  int items_per_thread = 8;    // split long items until about this many per thread
  int min_split_keys = 256;    // never split a key range below this
  int64_t min_item_cost = 2048;  // about a microsecond of work
};

// (query rows x visible keys) of tokens [t0, t1) whose first position is first_pos;
// with a sliding window (> 0) each token sees at most `window` keys.
inline int64_t tile_cost(int64_t first_pos, int64_t t0, int64_t t1, int group, int64_t window = 0) {
  const int64_t n = t1 - t0, a = first_pos + t0;
  // Positions a + i with a + i >= window see exactly `window` keys; the others a + i + 1.
  const int64_t capped = window > 0 ? std::max<int64_t>(0, a + n - std::max(a, window)) : 0;
  const int64_t u = n - capped;
  return group * (u * a + u * (u + 1) / 2 + capped * window);
}

// One past the last key tokens [t0, t1) of sequence s see: the last one's position + 1,
// or further with key_ends (a span attending both ways).
inline int tile_key_end(const AttnParams& p, int s, int first_pos, int t0, int t1) {
  int end = first_pos + t1;
  if (p.key_ends != nullptr)
    for (int t = t0; t < t1; ++t) end = std::max(end, int(p.key_ends[p.query_start_loc[s] + t]));
  return end;
}

// First block of a sequence any of its queries can see: with a window, earlier table
// entries may name freed blocks (any id) and are neither checked nor read.
inline int first_visible_block(const AttnParams& p, int ctx, int q_len) {
  if (p.sliding_window <= 0) return 0;
  return std::max(0, ctx - q_len - p.sliding_window + 1) / p.block_size;
}

// Raises std::invalid_argument (ValueError in Python) on malformed metadata, before
// any kernel reads through it.
inline void validate_attention(const AttnParams& p, int num_seqs, int max_blocks, int64_t num_blocks,
                               int64_t num_tokens) {
  if (p.query_start_loc[0] < 0 || p.query_start_loc[num_seqs] > num_tokens)
    throw std::invalid_argument("query_start_loc points outside the " + std::to_string(num_tokens) + " query tokens");
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int ctx = p.seq_lens[s];
    if (q_len < 0) throw std::invalid_argument("query_start_loc must be non-decreasing");
    if (q_len == 0) continue;
    if (ctx < q_len)
      throw std::invalid_argument("sequence " + std::to_string(s) + ": seq_len " + std::to_string(ctx) +
                                  " is shorter than its " + std::to_string(q_len) + " query tokens");
    const int n_blocks = (ctx + p.block_size - 1) / p.block_size;
    if (n_blocks > max_blocks)
      throw std::invalid_argument("sequence " + std::to_string(s) + " needs " + std::to_string(n_blocks) +
                                  " blocks but block_tables has " + std::to_string(max_blocks) + " columns");
    if (p.key_ends != nullptr)
      for (int t = 0; t < q_len; ++t) {
        const int end = p.key_ends[p.query_start_loc[s] + t], pos = ctx - q_len + t;
        if (end <= pos || end > ctx)
          throw std::invalid_argument("sequence " + std::to_string(s) + ": key_ends " + std::to_string(end) +
                                      " of the token at position " + std::to_string(pos) + " is outside [" +
                                      std::to_string(pos + 1) + ", " + std::to_string(ctx) + "]");
      }
    const int32_t* row = p.block_tables + s * p.bt_stride;
    for (int b = first_visible_block(p, ctx, q_len); b < n_blocks; ++b)
      if (row[b] < 0 || row[b] >= num_blocks)
        throw std::invalid_argument("sequence " + std::to_string(s) + ": block id " + std::to_string(row[b]) +
                                    " out of range [0, " + std::to_string(num_blocks) + ")");
  }
}

inline AttnPlan plan_attention(const AttnParams& p, int num_seqs, int num_threads,
                               const AttnPlanConfig& cfg = {}) {
  const int group = p.num_heads / p.num_kv_heads;
  const int tile_tokens = std::max(1, cfg.tile_rows / group);
  int64_t total = 0, tiles = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    total += tile_cost(p.seq_lens[s] - q_len, 0, q_len, group, p.sliding_window) * p.num_kv_heads;
    tiles += (q_len + tile_tokens - 1) / tile_tokens;
  }
  const int64_t want_items = int64_t(num_threads) * cfg.items_per_thread;
  // Enough (sequence, tile) pairs: give each item every kv head, so a block is read as
  // one contiguous run (fewer TLB misses, streaming prefetch).  Otherwise one kv head
  // per item, and split long contexts too.
  const int heads = (num_threads <= 1 || tiles >= want_items) ? p.num_kv_heads : 1;
  const int64_t target = num_threads > 1 ? std::max(total / want_items, cfg.min_item_cost) : INT64_MAX;

  AttnPlan plan;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int first_pos = p.seq_lens[s] - q_len;
    for (int t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int t1 = std::min(q_len, t0 + tile_tokens);
      const int keys = tile_key_end(p, s, first_pos, t0, t1);
      // Block-aligned start of the keys the tile's first token sees (0 without a window).
      int begin = 0;
      if (p.sliding_window > 0)
        begin = std::max(0, first_pos + t0 - p.sliding_window + 1) / p.block_size * p.block_size;
      const int range = keys - begin;
      const int64_t cost = tile_cost(first_pos, t0, t1, group, p.sliding_window) * heads;
      int splits = 1;
      if (cost > target)
        splits = int(std::min<int64_t>((cost + target - 1) / target, range / cfg.min_split_keys));
      splits = std::max(splits, 1);
      const int per = (range + splits - 1) / splits;
      const int span = (per + p.block_size - 1) / p.block_size * p.block_size;  // block aligned
      splits = (range + span - 1) / span;
      const int rows = (t1 - t0) * group * heads;
      for (int h = 0; h < p.num_kv_heads; h += heads) {
        if (splits == 1) {
          plan.work.push_back({s, h, h + heads, t0, t1, begin, keys, -1, cost});
          continue;
        }
        plan.merges.push_back({s, h, h + heads, t0, t1, plan.partial_rows, splits});
        for (int i = 0; i < splits; ++i)
          plan.work.push_back({s, h, h + heads, t0, t1, begin + i * span, std::min(keys, begin + (i + 1) * span),
                               plan.partial_rows + int64_t(i) * rows, cost / splits});
        plan.partial_rows += int64_t(splits) * rows;
      }
    }
  }
  std::stable_sort(plan.work.begin(), plan.work.end(),
                   [](const AttnWork& a, const AttnWork& b) { return a.cost > b.cost; });
  return plan;
}

}  // namespace pagedserve_cpu
