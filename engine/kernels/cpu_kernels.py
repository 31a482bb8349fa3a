"""C++ kernels for the CPU engine (float32): paged decode attention that reads
K/V in place from the cache blocks, the fused small ops of
engine/kernels/fused_ops.py's API (RMSNorm with the residual add, SiLU-and-mul,
rotary on q and k), and linear layers over weights packed in column panels.

Decode attention.
The torch backend gathers every decoding sequence's blocks into a dense copy
(`index_select`) and runs SDPA on it: three passes over the context's K/V per
layer. This kernel reads each K and V row once, in place. A task is one
sequence, all its KV heads, so each token's K/V row is read whole and in order
(splitting a sequence's heads over threads measured slower, even for one
sequence), run on ATen's
thread pool; it scores the query heads that share each KV head, takes the
softmax in float32 and sums the values, so GQA and MQA read each KV byte once.

Measured on the `bench` preset, 2 cores (A/B in one process): a decode step of
16 sequences at 300 tokens of context took 19.0 against 19.5 ms and 20.9
against 22.1 ms (two runs), at 1,200 tokens 37.4 against 40.5 ms, and 2
sequences at 1,200 tokens 8.7 against 9.6 ms; alone on the engine's own
inputs the kernel takes 0.27 ms per layer at 16 × 324 tokens.

Linear layers over weights packed in column panels (`panel_linear`; which
batch sizes take it is measured at load, engine/model/cpu_gemm.py). The
panels are handed out to the threads dynamically, as the attention's
sequences are; on the `bench` preset's 32 decoder-layer linears at 16 rows,
5.8 ms against oneDNN's 6.4.

Fused small ops. A decoder layer's norms, rotary and SiLU were ~50 torch ops,
each a Python call and an OpenMP region; here they are four calls. Same A/B:
a decode step of 1 sequence took 6.2 against 7.3 ms, 2 sequences 8.0 against
11.7 ms, 16 sequences 21.0 against 22.1 ms.

The extension is compiled on first use with the C++ compiler torch's
`cpp_extension` finds (a few tens of seconds, then cached under
`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions). It is built for
the machine's own CPU (`-march=native`), so its name carries a digest of the
CPU's instruction-set flags: nodes of different CPUs that share one cache (a
home directory on NFS) each build their own, where one name would hand a node
another CPU's build and kill the process on its first unknown instruction. The
name also carries a digest of the source, the flags and torch's version, so two
versions of pdserve on one machine never load each other's build. A build is
serialised by a lock the kernel drops when its holder dies (torch's own lock
file, left behind by a process killed mid-build, made every later engine wait
for ever). Where it cannot be built, `available()` is False and the engine keeps
the torch backend.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <cfloat>
#include <cmath>
#include <vector>

// out, q: [B, H, D] float32; kv_cache: [2, num_blocks, block_size, KVH, D] float32;
// block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (keys each sequence attends to).
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && kv_cache.scalar_type() == torch::kFloat
              && out.scalar_type() == torch::kFloat, "float32 expected");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out [B, H, D] of one shape expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2)
              && kv_cache.size(3) > 0 && q.size(1) % kv_cache.size(3) == 0,
              "kv_cache [2, num_blocks, block_size, KVH, D] with D as q's and H a multiple of KVH expected");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kLong
              && block_tables.size(0) == q.size(0), "int64 block_tables [B, max_blocks] expected");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == torch::kLong && seq_lens.size(0) == q.size(0),
              "int64 seq_lens [B] expected");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t G = H / KVH;
  const int64_t token_stride = KVH * D, block_stride = block_size * token_stride;
  const float* k_base = kv_cache.data_ptr<float>();
  const float* v_base = k_base + num_blocks * block_stride;
  const float* q_base = q.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  auto tables = block_tables.accessor<int64_t, 2>();
  auto lens = seq_lens.accessor<int64_t, 1>();
  const float fscale = static_cast<float>(scale);
  // (checked here, not in the parallel loop, which cannot throw)
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_tables.size(1) * block_size, "sequence ", b, " attends to ",
                lens[b], " keys: 1 to its table's ", block_tables.size(1) * block_size, " expected");
    for (int64_t i = 0; i * block_size < lens[b]; ++i)
      TORCH_CHECK(tables[b][i] >= 0 && tables[b][i] < num_blocks, "sequence ", b, "'s block ", i, " is ",
                  tables[b][i], ", not one of the cache's ", num_blocks);
  }

  // one task per sequence, all its KV heads (each token's K/V row read whole, in order), however
  // few sequences there are: splitting a sequence's heads over threads measured slower in the
  // model (bench preset, 2 threads, 280 keys: 1 sequence 1.0 against 0.53 ms a step, 3 sequences
  // 1.9 against 1.0 ms) and no faster alone up to 4,000 keys. Sequences are handed out one at a
  // time (dynamic): a thread that loses its core to another process leaves the sequences it has
  // not started to the others instead of holding them all at the end of the loop.
  if (B == 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), B);   // >= 1
  #pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scores, acc(H * D), row_max(H), row_sum(H);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = lens[b];
      const float* qr = q_base + b * H * D;                   // its H query heads, contiguous
      scores.resize(H * L);
      std::fill(row_max.begin(), row_max.end(), -FLT_MAX);   // finite: built with -ffast-math
      // block by block: the table lookup once per block, not once per key
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const float* kb = k_base + tables[b][t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* k = kb + i * token_stride;
          for (int64_t r = 0; r < H; ++r) {
            const float* qh = qr + r * D;
            const float* kr = k + (r / G) * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * kr[d];
            dot *= fscale;
            scores[r * L + t0 + i] = dot;
            row_max[r] = std::max(row_max[r], dot);
          }
        }
      }
      for (int64_t r = 0; r < H; ++r) {
        float sum = 0.f;
        float* sr = scores.data() + r * L;
        const float m = row_max[r];
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < L; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
        row_sum[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        const float* vb = v_base + tables[b][t0 / block_size] * block_stride;
        const int64_t n = std::min(block_size, L - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* v = vb + i * token_stride;
          for (int64_t r = 0; r < H; ++r) {
            const float p = scores[r * L + t0 + i];
            const float* vr = v + (r / G) * D;
            float* a = acc.data() + r * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t r = 0; r < H; ++r) {
        float* o = o_base + (b * H + r) * D;
        const float inv = 1.f / row_sum[r];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
    }
  }
}

// ---- fused small ops (float32, rows contiguous) ------------------------------------------
// x32 * rsqrt(mean(x32^2) + eps) * weight for each row, as engine/model/llama.RMSNorm.
static inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
  #pragma omp simd reduction(+:ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / n + eps);
  #pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// The fused ops' operands: float32, contiguous, `x` [T, N] and `out` of `out_cols` columns.
static void check_rows(const torch::Tensor& out, const torch::Tensor& x, int64_t out_cols) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous()
              && x.scalar_type() == torch::kFloat && out.scalar_type() == torch::kFloat,
              "contiguous float32 x and out [T, N] expected");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == out_cols, "out [", x.size(0), ", ", out_cols,
              "] expected for x ", x.sizes());
}

static void check_norm_weight(const torch::Tensor& weight, const torch::Tensor& x) {
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == torch::kFloat && weight.numel() == x.size(1),
              "contiguous float32 weight [", x.size(1), "] expected");
}

// out [T, N] = rms_norm(x [T, N]) * weight [N]
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(out, x, x.size(-1));
  check_norm_weight(weight, x);
  const int64_t T = x.size(0), N = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * N, wp, op + t * N, N, static_cast<float>(eps));
  });
}

// residual += x; out = rms_norm(residual) * weight   (residual updated in place)
void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                        double eps) {
  check_rows(out, x, x.size(-1));
  check_rows(residual, x, x.size(-1));
  check_norm_weight(weight, x);
  const int64_t T = x.size(0), N = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* r = rp + t * N;
      const float* xr = xp + t * N;
      #pragma omp simd
      for (int64_t i = 0; i < N; ++i) r[i] += xr[i];
      norm_row(r, wp, op + t * N, N, static_cast<float>(eps));
    }
  });
}

// out [T, I] = silu(gate) * up for x [T, 2I] = cat(gate, up)
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x [T, 2I] expected");
  check_rows(out, x, x.size(1) / 2);
  const int64_t T = x.size(0), I = out.size(1);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *g = xp + t * 2 * I, *u = g + I;
      float* o = op + t * I;
      #pragma omp simd
      // exp's argument capped below FLT_MAX's log: past it exp gives inf, and with -ffast-math
      // g / inf is inf * 0 = NaN, not silu's -0 (a gate of -300 would poison the whole forward)
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(std::min(-g[i], 88.f))) * u[i];
    }
  });
}

// NeoX rotary of x [T, heads, D] (rows may be strided; last dim contiguous) into out [T, heads, D]
// contiguous: out = x * cos[pos] + rotate_half(x) * sin[pos], cos/sin [P, D] float32.
void rotary(torch::Tensor out, torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && x.scalar_type() == torch::kFloat,
              "float32 x [T, heads, D] with D even and its last dimension contiguous expected");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
              "contiguous float32 out of x's shape expected");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2) && cos.is_contiguous()
              && sin.is_contiguous() && cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat,
              "contiguous float32 cos and sin [positions, D] expected");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong && positions.size(0) == x.size(0),
              "int64 positions [T] expected");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto pos = positions.accessor<int64_t, 1>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " is past the ", cos.size(0),
                "-position tables");
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *c = cp + pos[t] * D, *s = sp + pos[t] * D;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + t * st + h * sh;
        float* o = op + (t * H + h) * D;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o[i] = xr[i] * c[i] - xr[i + half] * s[i];
          o[i + half] = xr[i + half] * c[i + half] + xr[i] * s[i + half];
        }
      }
    }
  });
}

// ---- linear layers over weights packed in column panels -----------------------------------
// The weight [N, K] is packed once at load into panels of kPanel output columns, [P, K, kPanel]
// (zero-padded past N), so a panel streams from memory in order while a tile of rows accumulates
// in registers: each weight vector is loaded once per tile and used by every row of it. A decode
// step (a row per sequence, up to kTileRows) is one tile of all its rows over one panel; more rows
// go in tiles of kWideTileRows rows over two panels, which load fewer operands per multiply-add.
// Panels are handed out kChunkPanels at a time (dynamic): a thread that loses its core to another
// process leaves the chunks it has not started to the others instead of holding them all at the
// end of the layer.
#if defined(__AVX512F__)
constexpr int kPanel = 16;         // one 512-bit register of float32
constexpr int kTileRows = 16;      // one panel: 16 accumulators + its weight vector, of 32 registers
constexpr int kWideTileRows = 12;  // two panels: 24 accumulators + two weight vectors
#else
constexpr int kPanel = 8;          // one 256-bit register
constexpr int kTileRows = 8;       // 8 + 1 of 16 registers
constexpr int kWideTileRows = 6;   // 12 + 2
#endif
constexpr int64_t kChunkPanels = 2;
constexpr int64_t kPrefetchRows = 32;   // weight rows (kPanel floats each) ahead of the one in use
typedef float PanelVec __attribute__((vector_size(kPanel * sizeof(float))));

int64_t panel_width() { return kPanel; }

// For R rows and C panels (C panels_apart floats apart): out[r, c * kPanel + j] = sum_k xt[k, r] *
// w_c[k, j] for j < cols_c, where the last panel has `last_cols` columns; xt rows ldx apart, out rows
// ldo apart.
template <int R, int C>
static void panel_tile(const float* xt, int64_t ldx, int64_t K, const float* w, int64_t panels_apart,
                       float* out, int64_t ldo, int64_t last_cols) {
  PanelVec acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = PanelVec{};
  for (int64_t k = 0; k < K; ++k) {
    PanelVec wk[C];
    for (int c = 0; c < C; ++c) {
      const float* wc = w + c * panels_apart + k * kPanel;
      std::memcpy(&wk[c], wc, sizeof(PanelVec));
      __builtin_prefetch(wc + kPrefetchRows * kPanel);   // past the end is harmless: no fault
    }
    const float* xk = xt + k * ldx;
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xr = xk[r];
      for (int c = 0; c < C; ++c) acc[r][c] += xr * wk[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      std::memcpy(out + r * ldo + c * kPanel, &acc[r][c], (c == C - 1 ? last_cols : kPanel) * sizeof(float));
}

using PanelTileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <int C, size_t... I>
static constexpr std::array<PanelTileFn, sizeof...(I)> panel_tiles(std::index_sequence<I...>) {
  return {{&panel_tile<I + 1, C>...}};
}
static constexpr auto kNarrowTiles = panel_tiles<1>(std::make_index_sequence<kTileRows>{});    // [R - 1]
static constexpr auto kWideTiles = panel_tiles<2>(std::make_index_sequence<kWideTileRows>{});  // [R - 1]

// x [M, K] float32, panels [P, K, kPanel] -> out [M, N] = x @ W^T (N <= P * kPanel)
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat
              && panels.scalar_type() == torch::kFloat, "contiguous float32 x [M, K] expected");
  TORCH_CHECK(panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == x.size(1)
              && N <= panels.size(0) * kPanel && N > (panels.size(0) - 1) * kPanel,
              "panels [P, K, ", kPanel, "] matching x and N expected");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // x rearranged so that a tile's rows of one k sit side by side, each tile's rows in one stream:
  // [K, M] for one tile (M <= kTileRows), else [ceil(M / kWideTileRows), K, kWideTileRows] (zero-padded).
  // Plain loops: ATen's strided copy took ~15 us for 16 x 512 floats, 4% of a decode step.
  const bool wide = M > kTileRows;
  const int64_t tile_rows = wide ? kWideTileRows : M;
  const int64_t tiles = (M + tile_rows - 1) / tile_rows;
  auto xt = torch::empty({tiles * tile_rows * K}, x.options());
  {
    const float* src = x.data_ptr<float>();
    float* dst = xt.data_ptr<float>();
    for (int64_t t = 0; t < tiles; ++t) {
      float* tile = dst + t * K * tile_rows;
      for (int64_t r = 0; r < tile_rows; ++r) {
        const int64_t m = t * tile_rows + r;
        if (m < M) {
          const float* row = src + m * K;
          for (int64_t k = 0; k < K; ++k) tile[k * tile_rows + r] = row[k];
        } else {
          for (int64_t k = 0; k < K; ++k) tile[k * tile_rows + r] = 0.f;
        }
      }
    }
  }
  const float* xp = xt.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panel_size = K * kPanel;
  const int64_t chunks = (P + kChunkPanels - 1) / kChunkPanels;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  #pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t p0 = chunk * kChunkPanels, p1 = std::min(P, p0 + kChunkPanels);
    const float* w = wp + p0 * panel_size;
    if (wide && p1 - p0 == 2) {                               // two panels at once, kWideTileRows rows a tile
      const int64_t last_cols = std::min<int64_t>(kPanel, N - (p0 + 1) * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += kWideTileRows) {
        const int64_t rows = std::min<int64_t>(kWideTileRows, M - m0);
        kWideTiles[rows - 1](xp + m0 * K, kWideTileRows, K, w, panel_size, op + m0 * N + p0 * kPanel, N,
                             last_cols);
      }
      continue;
    }
    for (int64_t p = p0; p < p1; ++p, w += panel_size) {       // one panel at a time (x's tiles as laid out)
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
        const int64_t rows = std::min<int64_t>(tile_rows, M - m0);
        kNarrowTiles[rows - 1](xp + m0 * K, tile_rows, K, w, panel_size, op + m0 * N + p * kPanel, N, cols);
      }
    }
  }
  return out;
}
"""

FUNCTIONS = ["paged_decode_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary",
             "panel_width", "panel_linear"]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

_lock = threading.Lock()
_module = None
_failed = False


def extension_name(cpuinfo: str | None = None) -> str:
    """The extension's build name: one per instruction set. `cpuinfo` is
    /proc/cpuinfo's text (read when None); its first `flags` line (x86) or
    `Features` line (arm) is digested, else the platform's machine and processor."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    isa = next((line.partition(":")[2] for line in cpuinfo.splitlines()
                if line.split(":")[0].strip() in ("flags", "Features")), None)
    if isa is None:
        isa = f"{platform.machine()} {platform.processor()}"
    digest = hashlib.sha256(" ".join(sorted(isa.split())).encode()).hexdigest()[:12]
    build = hashlib.sha256("\0".join([_SOURCE, *CFLAGS, torch.__version__]).encode()).hexdigest()[:8]
    return f"pdserve_cpu_kernels_{digest}_{build}"


def _build():
    """Compiles (or loads the cached build of) the extension, one process at a time."""
    from torch.utils.cpp_extension import _get_build_directory, load_inline
    name = extension_name()
    directory = _get_build_directory(name, verbose=False)
    with open(os.path.join(directory, "pdserve-build.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # released by the kernel if this process dies
        stale = os.path.join(directory, "lock")    # torch's, which no live builder holds now
        if os.path.exists(stale):
            log.warning("removing %s, left by a build that was killed", stale)
            os.remove(stale)
        return load_inline(name=name, cpp_sources=_SOURCE, functions=FUNCTIONS, extra_cflags=CFLAGS,
                           extra_ldflags=["-fopenmp"], build_directory=directory, verbose=False)


def _load():
    global _module, _failed
    if _module is not None:   # every kernel call comes here: no lock once built
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                _module = _build()
            except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the torch backend serves
                _failed = True
                log.warning("the C++ CPU kernels could not be built (%s); using the torch backend and "
                            "oneDNN's linears", exc)
    return _module


def available() -> bool:
    """Whether the kernel is built (building it on the first call)."""
    return _load() is not None


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """q, out: [B, heads, D] float32; kv_cache: [2, num_blocks, block_size, kv_heads, D];
    block_tables: [B, max_blocks] int64 (rows may be padded); seq_lens: [B] int64.
    Writes softmax(q K^T * scale) V over each sequence's first seq_lens[b] keys into `out`."""
    _load().paged_decode_attention(out, q, kv_cache, block_tables, seq_lens, scale)
    return out


# ---- fused small ops, the API of engine/kernels/fused_ops.py (float32 on CPU) -----------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> rms_norm(x) * weight, a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _load().rms_norm(out, x, weight.contiguous(), eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); the sum is written into
    `residual` (the stream the next layer adds to) and returned."""
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x)
    _load().fused_add_rms_norm(out, x, residual, weight.contiguous(), eps)
    return out, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2n] = cat(gate, up) -> silu(gate) * up [T, n]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    _load().silu_and_mul(out, x)
    return out


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE of q [T, H, D] and k [T, KV, D] (last dim contiguous) at positions [T]
    with the [max_positions, D] float32 tables; new contiguous q and k."""
    positions = positions.to(torch.long)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    module = _load()
    module.rotary(q_out, q, cos, sin, positions)
    module.rotary(k_out, k, cos, sin, positions)
    return q_out, k_out


# ---- linear layers over weights packed in column panels -----------------------------------
def panel_width() -> int:
    """Output columns per panel: one SIMD register of float32 (16 with AVX-512, else 8)."""
    return _load().panel_width()


def pack_panels(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """weight [N, K] float32 -> panels [ceil(N / W), K, W] for panel_linear (W: `width`, default
    panel_width()), zero-padded past N."""
    width = width or panel_width()
    n, k = weight.shape
    num_panels = -(-n // width)
    padded = torch.zeros(num_panels * width, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(num_panels, width, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [T, K] float32 @ W^T -> [T, out_features], W packed by pack_panels."""
    return _load().panel_linear(x.contiguous(), panels, out_features)
