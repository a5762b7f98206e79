// cuda/device.cu compiled for the emulated device (cuda/emu/cuda_emu.h).
#include "../device.cu"
