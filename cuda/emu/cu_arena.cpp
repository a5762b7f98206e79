// cuda/arena.cu compiled for the emulated device (cuda/emu/cuda_emu.h).
#include "../arena.cu"
