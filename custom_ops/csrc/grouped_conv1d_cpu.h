// The raw-pointer interface between the GroupedConv1d op (grouped_conv1d.cpp: input
// checks, dispatch, work sharing, registration) and its CPU kernel variants, one file
// per instruction set, each compiled with its own target flags (custom_ops/CMakeLists.txt):
//
//   grouped_conv1d_generic.cpp  portable C++ (GCC vector types, no intrinsics): any CPU
//   grouped_conv1d_avx2.cpp     AVX2 + FMA + F16C, blocked for 16 ymm registers
//   grouped_conv1d_avx512.cpp   AVX-512 F/BW/VL/DQ, blocked for 32 zmm registers
//   grouped_conv1d_amx.cpp      AMX-BF16 tiles (bf16, 16 channels per group), and the same
//                               kernels on emulated tiles in grouped_conv1d_amx_emulated.cpp
//
// No torch header here or in the variants: an inline function compiled with AVX-512
// flags in one file must never be the copy the linker keeps for another
// (tests/test_grouped_conv1d.py checks the built library with objdump).
//
// Letters: B batch, S sequence, H hidden, C channels per group, G = H / C groups,
// K kernel width (odd), P = K / 2, CP = C rounded up to a lane count (4, 8, ..., 64).
#pragma once

#include <cstddef>
#include <cstdint>

namespace groupbert::conv {

// Channels per group the kernels take (a group's lanes are held in registers);
// custom_ops/grouped_conv1d.py MAX_CHANNELS_PER_GROUP must equal it.
constexpr int64_t kMaxChannelsPerGroup = 64;

// Sequence positions per work item: a tile of one batch row.
constexpr int64_t kTileRows = 16;

enum class Dtype { kFloat, kDouble, kBFloat16, kHalf };

struct Shape {
  int64_t B, S, H, C, K, G, P;
};

// The lane count CP that holds C channels.
constexpr int64_t lanes_for(int64_t C) { return C <= 4 ? 4 : C <= 8 ? 8 : C <= 16 ? 16 : C <= 32 ? 32 : 64; }

// Bytes of scratch a worker passes to the kernels (the gathered input window and the
// grad-output tile, in the accumulation type), 64-byte aligned.
constexpr size_t scratch_bytes(const Shape& s) {
  return static_cast<size_t>((2 * kTileRows + s.K - 1) * lanes_for(s.C)) * sizeof(double) + 64;
}

// out = conv(in masked by in_mask), rows where out_mask is 0 written as zero, over the
// work items [begin, end) (item = (batch row b, tile of kTileRows positions)).
// `weights` are packed (G, K, C, CP) in the accumulation type (double for kDouble,
// float otherwise): weights[g][k][c][j] = the weight from input channel c to output
// lane j at tap k. The forward pass packs conv1d's weight; grad-input packs it
// transposed within each group and flipped along K, and passes grad_out as `in`.
//
// With `sequence_ids` (B, S) (packed sequences; in_mask and out_mask are then null), an
// input row feeds an output row only where both carry the same id, and id 0 marks
// padding: every sequence is convolved as if alone, zero padded at its boundaries, and
// rows of id 0 are written as zero. The relation is symmetric, so grad-input follows
// the same rule. A tile whose rows hold several ids runs once per id (see SequencePasses).
struct ConvCall {
  const void* in;
  const bool* in_mask;
  const bool* out_mask;
  const int64_t* sequence_ids;
  const void* weights;
  void* out;
  Shape shape;
  Dtype dtype;
};

// partials[worker] (G, K, CP, CP) += over the items [begin, end) and (b, s) in them:
// gout[b, s, g*C + j] * xm[b, s + k - P, g*C + c] at [g][k][c][j], xm = x masked.
// With `sequence_ids` (mask null) only pairs of rows with the same non-zero id count.
struct GradWeightCall {
  const void* gout;
  const void* x;
  const bool* mask;
  const int64_t* sequence_ids;
  void* partials;  // (workers, G, K, CP, CP), accumulation type, zeroed by the caller
  Shape shape;
  Dtype dtype;
};

// The sequences of one tile of output rows [s0, s0 + rows) of a batch row. Without ids
// there is one pass over every row (kAnySequence). With ids, one pass per distinct
// non-zero id among the rows, in order of first appearance: a pass reads only window
// rows of its id and writes only output rows of its id. Tiles inside one sequence (all
// but those at a boundary) take one pass. A template on the kernel variant's type, so
// that each variant compiles its own copy under its own name (see the top of this file).
constexpr int64_t kAnySequence = -1;
template <class Variant>
struct SequencePasses {
  int64_t ids[64];  // one per pass; tiles are at most 64 rows
  int count = 0;
  bool padding = false;  // some row has id 0 (written as zero)

  SequencePasses(const int64_t* row_ids, int64_t rows) {
    if (row_ids == nullptr) {
      ids[count++] = kAnySequence;
      return;
    }
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t id = row_ids[t];
      if (id == 0) {
        padding = true;
        continue;
      }
      bool seen = false;
      for (int i = 0; i < count && !seen; ++i) seen = ids[i] == id;
      if (!seen) ids[count++] = id;
    }
  }

  // Whether input row s (in range) feeds the pass over `id`: unmasked and, with ids, of that id.
  static bool live(const bool* mask, const int64_t* sequence_ids, int64_t id, int64_t s) {
    return (mask == nullptr || mask[s]) && (sequence_ids == nullptr || sequence_ids[s] == id);
  }
};

struct Kernels {
  void (*conv)(const ConvCall& call, int64_t begin, int64_t end, void* scratch);
  void (*grad_weight)(const GradWeightCall& call, int64_t worker, int64_t begin, int64_t end, void* scratch);
};

namespace generic {
const Kernels& kernels();
}
#ifdef GROUPBERT_X86_KERNELS
namespace avx2 {
const Kernels& kernels();
}
namespace avx512 {
const Kernels& kernels();
}
#endif

}  // namespace groupbert::conv
