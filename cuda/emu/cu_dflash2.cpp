// cuda/dflash2.cu compiled for the emulated device (cuda/emu/cuda_emu.h).
#include "../dflash2.cu"
