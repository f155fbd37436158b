# Issue 22 §3 ("walls without doors"): the renames that turn private
# cross-layer names into public doors, applied to the whole tree at once:
#   git ls-files '*.c' '*.h' | xargs sed -i -E -f tools/house_renames.sed
# (re-runnable: an already renamed tree is left as it is).
#
# safetensors: the format's own folder and public header (safetensors/safetensors.h)
s/\bts__st_entry\b/ts_safetensors_entry/g
s/\bts__st_header\b/ts_safetensors_header/g
s/\bts__st_read_header\b/ts_safetensors_header_read/g
s/\bts__st_header_fini\b/ts_safetensors_header_fini/g
s/\bts__st_read_at\b/ts_safetensors_read_at/g
s/\bts__st_dtype_name\b/ts_safetensors_dtype_name/g
s/\bts__st_dtype_from_name\b/ts_safetensors_dtype_from_name/g
s/\bts__st_desc\b/ts_safetensors_desc/g
s/\bts__st_stream\b/ts_safetensors_writer/g
s/\bts__st_stream_open\b/ts_safetensors_writer_open/g
s/\bts__st_stream_put\b/ts_safetensors_writer_put/g
s/\bts__st_stream_commit\b/ts_safetensors_writer_commit/g
s/\bts__st_stream_abort\b/ts_safetensors_writer_abort/g
#
# tensor: public doors (tensor/tensor.h)
s/\bts__tensor_new_cpu\b/ts_tensor_new_cpu/g
s/\bts__shape_str\b/ts_shape_str/g
# mesh: public door (mesh/mesh.h)
s/\bts__mesh_world\b/ts_mesh_world/g
