// Copying a host buffer. Every copy of user data in the core goes through copy_bytes()
// rather than memcpy, for one measured reason:
//
// glibc (2.36 here) copies sizes from a few KiB up to about the L2 cache's with the
// `rep movsb` instruction. On the development machine's AMD EPYC, `rep movsb` runs
// 10-17x slower when the destination lies 1-63 bytes past the source modulo 4 KiB
// ("4K aliasing": the CPU matches loads against earlier stores by their offset within
// a page, so each load waits on a store it does not depend on). A 32 KiB copy took
// 12.7 us instead of 0.76 us. Where two buffers fall is up to the user's arrays (and
// the allocator), so a benchmark saw `allgather(x, out=...)` of 64 KiB take 30 us with
// one out= array and 10 us with another of the same shape. Copied in 2 KiB pieces,
// below the size where glibc turns to `rep movsb`, the same copy takes glibc's vector
// loop, which copies such a pair backwards and so never waits: 0.71 us.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ringreduce {

// The offsets (destination minus source, modulo 4 KiB) at which memcpy may alias.
constexpr uintptr_t kAliasingGap = 64;
// Pieces this small never take `rep movsb` (its threshold is 2-8 KiB, by vector width).
constexpr size_t kCopyPieceBytes = 2048;
// From about the L2 cache's size (glibc's limit for `rep movsb` on AMD; 512 KiB here)
// glibc copies without `rep movsb` and does not alias, while 2 KiB pieces then run
// slower than one memcpy (512 KiB: 37 us against 16 us).
constexpr size_t kAliasingMaxBytes = 512 << 10;

// Whether the byte ranges [a, a + a_bytes) and [b, b + b_bytes) cross: share a byte, or
// one is empty and lies strictly inside the other.
inline bool ranges_overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// memmove(dst, src, bytes), as fast as memcpy wherever the two buffers lie.
inline void copy_bytes(void* dst, const void* src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (bytes == 0 || d == s) return;
  const uintptr_t to = reinterpret_cast<uintptr_t>(d), from = reinterpret_cast<uintptr_t>(s);
  const uintptr_t gap = (to - from) & 4095;
  if (ranges_overlap(d, bytes, s, bytes) || gap == 0 || gap >= kAliasingGap ||
      bytes <= kCopyPieceBytes || bytes >= kAliasingMaxBytes) {
    std::memmove(d, s, bytes);
    return;
  }
  for (size_t done = 0; done < bytes; done += kCopyPieceBytes) {
    const size_t n = bytes - done < kCopyPieceBytes ? bytes - done : kCopyPieceBytes;
    std::memcpy(d + done, s + done, n);
  }
}

// Whether copy_streaming() streams (x86-64: SSE2's non-temporal stores, which every
// x86-64 CPU has); elsewhere it is copy_bytes().
#if defined(__x86_64__)
constexpr bool kStreamingStores = true;
#else
constexpr bool kStreamingStores = false;
#endif

// copy_bytes() for a shared-memory slot that another core reads next, with stores that
// bypass this core's caches: the lines then come to the reader from memory instead of
// from this core's cache. Between cores that share a cache, that is slower (up to 1.55x
// on the development machine, 2 ranks); between cores that do not (other dies of a CPU,
// sockets, or a VM's virtual CPUs placed so), fetching another core's freshly written
// lines costs more than memory, and streaming was 3.5-5.7x faster (docs/performance.md,
// wire_choice). Which holds is for the WireTuner to measure. dst and src must not
// overlap.
inline void copy_streaming(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  // From a cache line's start on: each line then goes out whole, in one write.
  const size_t head = (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64;
  if (bytes < head + 64) {
    copy_bytes(d, s, bytes);
    return;
  }
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
  // Non-temporal stores are not ordered with later ones: without the fence, the release
  // store that hands the slot to the reader could be seen before the data.
  _mm_sfence();
#else
  copy_bytes(dst, src, bytes);
#endif
}

}  // namespace ringreduce
