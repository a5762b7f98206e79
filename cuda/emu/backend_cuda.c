/* src/train/cuda/backend_cuda.c with CUDA, over the emulated device (cuda/emu). */
#include "../../src/train/cuda/backend_cuda.c"
