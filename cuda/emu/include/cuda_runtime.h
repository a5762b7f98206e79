// Emulated device (cuda/emu): stands in for CUDA's cuda_runtime.h.
#pragma once
#include "../cuda_emu.h"
