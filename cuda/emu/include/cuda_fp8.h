// Emulated device (cuda/emu): stands in for CUDA's cuda_fp8.h.
#pragma once
#include "../cuda_emu.h"
