// cuda/kernels.cu compiled for the emulated device (cuda/emu/cuda_emu.h).
#include "../kernels.cu"
