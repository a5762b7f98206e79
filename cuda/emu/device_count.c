/* src/train/cuda/device_count.c with CUDA, over the emulated device (cuda/emu). */
#include "../../src/train/cuda/device_count.c"
