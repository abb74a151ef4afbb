// The panel kernel's AMX tiles (variant 3 of csrc/panel_kernel.cpp, compiled before it in the same namespace):
// the host's leave to use them, the tile configuration and the tile loop over a pass of panels, and the loop's
// arithmetic in scalar C++ (variant 4) for hosts without AMX.
#include <torch/types.h>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PANEL_AMX 1
#endif

namespace {

constexpr int64_t TILE_NR = 16;  // outputs per panel (panel_kernel.cpp NR)

// Several bf16 rows on AMX (variant 3): the bf16 panel layout, (K2, 16) 32-bit lanes of an input pair of 16
// outputs, is the tile multiply's B operand as it lies (16 pairs of a panel: one 1 KB tile, rows 64 bytes
// apart), and 16 of the rows' (M, K) inputs, 32 at a time, are its A operand; one tdpbf16ps adds 16 rows x 16
// outputs x 32 inputs into fp32 sums (denormals flushed, as vdpbf16ps). At 16-64 rows one AVX512-BF16 core
// multiplies ~0.2 TFLOP/s, so a decode batch's Linears were compute-bound (oneDNN's prepacked kernel, 32 rows
// of SmolLM2's 3072 x 576 on 2 threads: 0.32 ms); on AMX the same is ~0.15 ms, near the weights' read. Needs K a
// multiple of 32 (every model the engine loads; others keep the vector code) and the rows padded to a multiple
// of 16 (amx_rows: the caller lays them out so). A panel's sums are the same k order whichever panels or rows
// share a pass, so the bits do not depend on the split over threads.
bool amx_ready() {
#if PANEL_AMX
  // the kernel grants a process the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

// x laid out for AMX: variant 3, several rows, K2 (input pairs) a multiple of 16: (ceil(M / 16) * 16, K2) rows
inline bool amx_rows(int64_t variant, int64_t M, int64_t K2) {
  return (variant == 3 || variant == 4) && M > 1 && K2 % 16 == 0;
}

// variant 4 (amx_emulated, any host): amx_block's arithmetic in scalar C++ on the same layout (each sum in fp32, a
// pair's two products in order), for tests of the tiles' layout, padding and stores where the CPU has no AMX
template <int PB, int MB>
void amx_block_emulated(const uint32_t* x, int64_t K2, const uint32_t* w, int64_t lanes, float* acc) {
  for (int mb = 0; mb < MB; ++mb)
    for (int pb = 0; pb < PB; ++pb) {
      float* c = acc + (mb * PB + pb) * 256;
      for (int i = 0; i < 256; ++i) c[i] = 0.f;
      for (int64_t k = 0; k < K2; ++k)
        for (int m = 0; m < 16; ++m) {
          const uint32_t a = x[(16 * mb + m) * K2 + k];
          for (int n = 0; n < 16; ++n) {
            const uint32_t b = w[pb * lanes + k * TILE_NR + n];
            float a0, a1, b0, b1;
            const uint32_t ua0 = a << 16, ua1 = a & 0xFFFF0000u, ub0 = b << 16, ub1 = b & 0xFFFF0000u;
            std::memcpy(&a0, &ua0, 4), std::memcpy(&a1, &ua1, 4), std::memcpy(&b0, &ub0, 4), std::memcpy(&b1, &ub1, 4);
            c[m * 16 + n] += a0 * b0;
            c[m * 16 + n] += a1 * b1;
          }
        }
    }
}

#if PANEL_AMX
constexpr int AMX_AHEAD = 2048;  // bytes of a panel's stream prefetched ahead of its tile loads

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows of 64 bytes: C 0-3 (fp32 sums), A 4-5 (rows' inputs), B 6-7 (panels)
inline void amx_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// PB panels (w, the next `lanes` later) x MB blocks of 16 rows (x, rows K2 lanes apart) -> acc, tile
// (mb, pb) at acc + (mb * PB + pb) * 256 (16 x 16 fp32)
template <int PB, int MB>
void amx_block(const uint32_t* x, int64_t K2, const uint32_t* w, int64_t lanes, float* acc) {
  _tile_zero(0);
  if constexpr (PB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (PB > 1 && MB > 1) _tile_zero(3);
  for (int64_t k = 0; k < K2; k += 16) {
    for (int l = 0; l < 16; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * TILE_NR) + AMX_AHEAD + 64 * l, _MM_HINT_T0);
      if constexpr (PB > 1) _mm_prefetch(reinterpret_cast<const char*>(w + lanes + k * TILE_NR) + AMX_AHEAD + 64 * l, _MM_HINT_T0);
    }
    _tile_loadd(6, w + k * TILE_NR, 64);
    _tile_loadd(4, x + k, K2 * 4);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PB > 1) {
      _tile_loadd(7, w + lanes + k * TILE_NR, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MB > 1) {
      _tile_loadd(5, x + 16 * K2 + k, K2 * 4);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (PB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 64);
  if constexpr (PB > 1) _tile_stored(1, acc + 256, 64);
  if constexpr (MB > 1) _tile_stored(2, acc + PB * 256, 64);
  if constexpr (PB > 1 && MB > 1) _tile_stored(3, acc + 768, 64);
}
#endif

}  // namespace
