// Emulated device (cuda/emu): stands in for CUDA's cuda_bf16.h.
#pragma once
#include "../cuda_emu.h"
