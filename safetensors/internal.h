/* Internals of safetensors/ (tests only). Not installed. */
#ifndef TS_SAFETENSORS_INTERNAL_H
#define TS_SAFETENSORS_INTERNAL_H

#include "base/internal.h"
#include "safetensors/safetensors.h"

/* Test hook of the writer (ts_safetensors_save, ts_safetensors_writer_open):
 * called with the temporary file's path once it is created (empty, mode
 * 0600); a non-zero return fails the open as a write error would. NULL
 * (the default) in normal use. */
extern int (*ts__safetensors_save_hook)(const char *tmp_path);

#endif
