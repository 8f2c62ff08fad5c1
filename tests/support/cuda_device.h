#pragma once
// Whether a CUDA device is present: GPU tests skip themselves without one
// (the same check `--device auto` makes).
#include "attn/cuda/cuda_backend.h"

inline bool have_cuda_device() { return dsv4::cuda_device_available(); }
