/*
 * Training a DFlash drafter: the umbrella over
 *   drafter.h  the drafter's configuration (config.json);
 *   trainer.h  the trainer object: create, accumulate, step, checkpoints,
 *              state, evaluation, drafting, the GPU memory plan;
 *   run.h      a whole training run (dflash train).
 * Including it is the same as including the three. The experimental oracle
 * hooks are in experimental.h (not included here).
 */
#ifndef DFLASH_TRAIN_H
#define DFLASH_TRAIN_H

#include <dflash/drafter.h>
#include <dflash/run.h>
#include <dflash/trainer.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Nothing of its own: see the headers above. */

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_TRAIN_H */
