// Row-consistent attention over listed keys on AMX tiles (``attention_amx.cpp``).
#pragma once

#include <torch/extension.h>

#include "vec16.h"

namespace cadence {

// Whether bf16 ``listed_attention`` runs on AMX tiles in this process: built for a CPU with
// AMX, the kernel granted tile data, CADENCE_AMX not 0. Decided at the first call, so every
// forward of a process reduces the same way.
bool amx_listed_on();

// Tests only: switch the AMX path on (where available) or off; returns the previous setting.
bool set_amx_listed(bool on);

// ``listed_attention`` for bf16 q (b, H, n, D), k, v (b, KV, L, D), D a multiple of 32,
// H / KV <= 16, into out (b, H, n, D) with its last dimension contiguous.
void amx_listed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const vec::Lists& lists,
                          at::Tensor& out, float scale);

}  // namespace cadence
