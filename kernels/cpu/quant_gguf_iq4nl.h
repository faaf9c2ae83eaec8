// GGUF IQ4_NL (ggml type 20): the format facts the kernels share.
//
// A block is Q4_0's: fp16 d | qs[16], element j < 16 the low nibble of qs[j], element
// j + 16 its high nibble.  A nibble is not a value but an index into a fixed non-linear
// table of 16 int8 levels (ggml-common.h kvalues_iq4nl): value = d * kIq4nlValues[nibble].
// The dot product with int8 activations is therefore Q8_0's once the nibbles are looked
// up: a byte shuffle (vpshufb) maps 16 nibbles at a time to their levels.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve_iq4nl {

constexpr int64_t kTypeId = 20;
constexpr int kBlockBytes = 18;
constexpr int8_t kValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

#if defined(__AVX512BW__)
// The levels + 128 (1..241) as unsigned bytes, in every 128-bit lane: vpdpbusd's unsigned
// operand; a block's accumulators then start at -128 * sum(x) (the tiled kernel's offset).
// (int8 v + 128 as a byte is v ^ 0x80.)
inline __m512i levels_u8_512() {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues));
  return _mm512_broadcast_i32x4(_mm_xor_si128(t, _mm_set1_epi8(static_cast<char>(0x80))));
}
#endif

#if defined(__AVX2__)
// The signed levels in both 128-bit lanes (the row kernel's sign trick, as Q8_0's).
inline __m256i levels_s8_256() {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kValues));
  return _mm256_set_m128i(t, t);
}

// The 32 levels (int8) of 16 bytes of nibbles qs (an IQ4_NL block's, an IQ4_XS sub-block's):
// element j < 16 from the low nibbles, j + 16 from the high ones; levels: levels_s8_256().
inline __m256i nibble_levels(const uint8_t* qs, __m256i levels) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
  return _mm256_shuffle_epi8(levels, nib);  // per 128-bit lane, both lanes holding the table
}
#endif

}  // namespace pagedserve_iq4nl
