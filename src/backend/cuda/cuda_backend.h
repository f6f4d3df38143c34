// The CUDA backend (Hopper, sm_90a). Plain C++: includable without CUDA headers.
//
// Activation dtype is chosen at construction and is what activation_dtype() reports; caches use
// it too. The two supported choices are two numerical paths, never mixed within a backend:
//   F32  — CUDA-core f32 FMA kernels everywhere (never tf32): the exactness path, for f32 (and
//          f16) checkpoints; weights of any float dtype are widened to f32 in the kernels.
//   BF16 — tensor-core kernels (mma.sync bf16 × bf16 → f32) for bf16 checkpoints; rounding to
//          bf16 happens at transformers' rounding points (architectures.md D.1). Needs bf16
//          matmul weights, inner dimensions that are multiples of 8 and attention head_dim in
//          {16, 32, 64, 128, 256}; anything else is a kiln::Error naming the op and shape.
// Every op's per-element reduction order is independent of the number of tokens, the batch
// composition and the chunking (see each kernel file's header comment).
#pragma once

#include <memory>

#include "backend/backend.h"
#include "core/dtype.h"

namespace kiln {

// Number of CUDA devices usable by this process (0 when there is no driver or no device).
int cuda_device_count();

// The activation dtype the CUDA backend uses for weights stored as `weights`: F32 for F32 and F16
// checkpoints, BF16 for BF16 ones.
DType cuda_activation_dtype_for(DType weights);

// A backend on CUDA device `device` keeping activations in `activations` (F32 or BF16).
std::unique_ptr<Backend> make_cuda_backend(int device = 0, DType activations = DType::BF16);

// The bytes a CUDA backend's caching allocator holds from the device (blocks in use and cached):
// what the memory plan's dry run predicts (tests/cuda/memory_plan_test.cpp). Fails for another backend.
uint64_t cuda_allocator_held_bytes(const Backend& backend);

}  // namespace kiln
