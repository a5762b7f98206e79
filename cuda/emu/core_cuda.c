/* src/core/cuda.c with CUDA, over the emulated device (cuda/emu). */
#include "../../src/core/cuda.c"
