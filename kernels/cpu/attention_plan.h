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

// (query rows x visible keys) of tokens [t0, t1) whose first position is first_pos.
inline int64_t tile_cost(int64_t first_pos, int64_t t0, int64_t t1, int group) {
  const int64_t n = t1 - t0;
  return group * (n * (first_pos + t0) + n * (n + 1) / 2);
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
    const int32_t* row = p.block_tables + s * p.bt_stride;
    for (int b = 0; b < n_blocks; ++b)
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
    total += tile_cost(p.seq_lens[s] - q_len, 0, q_len, group) * p.num_kv_heads;
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
      const int keys = first_pos + t1;
      const int64_t cost = tile_cost(first_pos, t0, t1, group) * heads;
      int splits = 1;
      if (cost > target)
        splits = int(std::min<int64_t>((cost + target - 1) / target, keys / cfg.min_split_keys));
      splits = std::max(splits, 1);
      const int per = (keys + splits - 1) / splits;
      const int span = (per + p.block_size - 1) / p.block_size * p.block_size;  // block aligned
      splits = (keys + span - 1) / span;
      const int rows = (t1 - t0) * group * heads;
      for (int h = 0; h < p.num_kv_heads; h += heads) {
        if (splits == 1) {
          plan.work.push_back({s, h, h + heads, t0, t1, 0, keys, -1, cost});
          continue;
        }
        plan.merges.push_back({s, h, h + heads, t0, t1, plan.partial_rows, splits});
        for (int i = 0; i < splits; ++i)
          plan.work.push_back({s, h, h + heads, t0, t1, i * span, std::min(keys, (i + 1) * span),
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
