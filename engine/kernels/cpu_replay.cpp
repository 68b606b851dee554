// Replays a recorded list of kernel calls (cpu_replay.py) in one call from Python.
//
// A decode step at batch 1 makes about ten kernel calls a layer, each a few microseconds of
// Python and ctypes around a few microseconds of work. Recorded once per token count, the
// step's calls run here back to back: the same entry points with the same arguments, so the
// same bits. Each call is a row of SLOTS int64 words: its prototype (KIND), the entry's
// address, then its arguments in order (pointers and integers as is, a float as the bits of
// an IEEE single in the low 32 bits). Before the calls run, each patch (row, argument,
// register) copies one register into one argument: what changes from step to step (the
// attention plan's tables and lengths, where K/V go).

#include <cstdint>
#include <cstring>

namespace {

using i64 = int64_t;
using P = void*;
constexpr i64 SLOTS = 24;  // kind, entry, 22 arguments

enum Kind : i64 {
  NORM = 0,       // pc_rms_norm_*
  ROTARY = 1,     // pc_rotary_*
  SILU = 2,       // pc_silu_and_mul_bf16
  GEMM_BF16 = 3,  // pc_gemm_bf16, pc_gemm_bf16_amx
  GEMM_F32 = 4,   // pc_gemm_f32
  QGEMM = 5,      // pc_qgemm_*
  WRITE_KV = 6,   // pc_write_kv
  ATTEND = 7,     // pc_row_attention_*
  GEMMA_NORMS = 8,  // pc_gemma_norms_*
  GELU = 9,       // pc_gelu_tanh_and_mul_bf16
};

inline P ptr(const i64* a, int i) { return reinterpret_cast<P>(a[i]); }
inline int num(const i64* a, int i) { return static_cast<int>(a[i]); }
inline float real(const i64* a, int i) {
  const uint32_t bits = static_cast<uint32_t>(a[i]);
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The entry's return code (0 for the void ones); -1000 for a kind this build does not know.
int call(const i64* row) {
  const i64* a = row + 2;
  const i64 entry = row[1];
  switch (row[0]) {
    case NORM:
      return reinterpret_cast<int (*)(P, i64, P, i64, P, P, i64, i64, i64, float, int)>(entry)(
          ptr(a, 0), a[1], ptr(a, 2), a[3], ptr(a, 4), ptr(a, 5), a[6], a[7], a[8], real(a, 9),
          num(a, 10));
    case ROTARY:
      return reinterpret_cast<int (*)(P, i64, i64, i64, P, i64, i64, i64, P, P, i64, i64, i64, P,
                                      P, float, float, int, int)>(entry)(
          ptr(a, 0), a[1], a[2], a[3], ptr(a, 4), a[5], a[6], a[7], ptr(a, 8), ptr(a, 9), a[10],
          a[11], a[12], ptr(a, 13), ptr(a, 14), real(a, 15), real(a, 16), num(a, 17), num(a, 18));
    case SILU:
      return reinterpret_cast<int (*)(P, i64, P, i64, i64, i64, int)>(entry)(
          ptr(a, 0), a[1], ptr(a, 2), a[3], a[4], a[5], num(a, 6));
    case GEMM_BF16:
      reinterpret_cast<void (*)(P, i64, i64, P, i64, i64, P, P, i64, int, int)>(entry)(
          ptr(a, 0), a[1], a[2], ptr(a, 3), a[4], a[5], ptr(a, 6), ptr(a, 7), a[8], num(a, 9),
          num(a, 10));
      return 0;
    case GEMM_F32:
      reinterpret_cast<void (*)(P, i64, i64, P, i64, i64, P, P, i64, int)>(entry)(
          ptr(a, 0), a[1], a[2], ptr(a, 3), a[4], a[5], ptr(a, 6), ptr(a, 7), a[8], num(a, 9));
      return 0;
    case QGEMM:
      reinterpret_cast<void (*)(P, i64, i64, P, i64, i64, int, P, P, i64, int)>(entry)(
          ptr(a, 0), a[1], a[2], ptr(a, 3), a[4], a[5], num(a, 6), ptr(a, 7), ptr(a, 8), a[9],
          num(a, 10));
      return 0;
    case WRITE_KV:
      return reinterpret_cast<int (*)(P, i64, P, i64, i64, P, i64, i64, P, i64, i64, i64, i64,
                                      i64, i64)>(entry)(
          ptr(a, 0), a[1], ptr(a, 2), a[3], a[4], ptr(a, 5), a[6], a[7], ptr(a, 8), a[9], a[10],
          a[11], a[12], a[13], a[14]);
    case ATTEND:
      return reinterpret_cast<int (*)(P, i64, i64, P, i64, P, i64, P, P, i64, P, i64, P, i64, i64,
                                      i64, float, float, i64, int)>(entry)(
          ptr(a, 0), a[1], a[2], ptr(a, 3), a[4], ptr(a, 5), a[6], ptr(a, 7), ptr(a, 8), a[9],
          ptr(a, 10), a[11], ptr(a, 12), a[13], a[14], a[15], real(a, 16), real(a, 17), a[18],
          num(a, 19));
    case GEMMA_NORMS:
      return reinterpret_cast<int (*)(P, P, P, P, P, i64, i64, float, int)>(entry)(
          ptr(a, 0), ptr(a, 1), ptr(a, 2), ptr(a, 3), ptr(a, 4), a[5], a[6], real(a, 7),
          num(a, 8));
    case GELU:
      return reinterpret_cast<int (*)(P, i64, P, i64, i64, i64, int, P)>(entry)(
          ptr(a, 0), a[1], ptr(a, 2), a[3], a[4], a[5], num(a, 6), ptr(a, 7));
  }
  return -1000;
}

}  // namespace

extern "C" {

int64_t pc_replay_slots() { return SLOTS; }

// Runs rows [0, n_rows) of `calls` after applying the patches ([n_patches, 3]: row,
// argument, register). Returns 0, or 1 + the index of the first call whose entry returned
// nonzero (its code in *failed_code; the calls after it do not run).
int64_t pc_replay(int64_t* calls, int64_t n_rows, const int64_t* patches, int64_t n_patches,
                  const int64_t* registers, int32_t* failed_code) {
  for (int64_t i = 0; i < n_patches; ++i) {
    const int64_t* p = patches + 3 * i;
    calls[p[0] * SLOTS + 2 + p[1]] = registers[p[2]];
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    const int rc = call(calls + r * SLOTS);
    if (rc != 0) {
      *failed_code = rc;
      return r + 1;
    }
  }
  return 0;
}

}  // extern "C"
