// cuda/backend.cu compiled for the emulated device (cuda/emu/cuda_emu.h).
#include "../backend.cu"
