# Points the code's citations of design notes kept outside the repository
# (DESIGN.md, FSDP2-NOTES.md, DEPS-GUIDE.md) at the repository's own docs/
# (docs/design.md carries their content; see its "Decisions",
# "PyTorch's mechanics that the code mirrors" and "Measured on the
# machines"). Content-based, not line-based, so it holds after code moves.
# Run once, after the merges of issue 22, from the source root:
#   git grep -lE 'DESIGN|FSDP2-NOTES|DEPS-GUIDE' -- '*.c' '*.h' '*.py' '*.sh' meson.build \
#     | xargs sed -i -E -f tools/rewrite_citations.sed
# then check: git grep -nE 'DESIGN|FSDP2-NOTES|DEPS-GUIDE' -- ':!docs' ':!tools/rewrite_citations.sed'

# --- DESIGN.md: the decisions keep their numbers (docs/design.md#d1-status-codes ... #d10-...)
s/DESIGN\.md (D[0-9])/docs\/design.md \1/g
s/\(DESIGN target: under 2 s\)/(the target: under 2 s; docs\/design.md D8)/g

# --- FSDP2-NOTES.md: PyTorch's mechanics
s/FSDP2-NOTES\.md §3\.1,? ?/docs\/design.md "DeviceMesh and DTensor"; /g
s/\(FSDP2-NOTES\.md §3\.2-3\.3, PyTorch's DTensor\)/(docs\/design.md, "DeviceMesh and DTensor"; PyTorch's DTensor)/g
s/FSDP2-NOTES\.md §1-§2\)/docs\/fully_shard.md)/g
s/FSDP2-NOTES\.md §2\)/docs\/fully_shard.md)/g
s/FSDP2-NOTES\.md §1\.3, §2\.5, §2\.6, §2\.13\)/docs\/fully_shard.md, "Gradient accumulation and microbatches"; docs\/design.md, "Gradient division")/g
s/FSDP2-NOTES\.md §1\.3,$/docs\/fully_shard.md, "Gradient accumulation and microbatches",/
s/^( \*) §2\.5, §2\.6, §2\.13\)\./\1 docs\/design.md, "Gradient division")./
s/FSDP2-NOTES\.md §1\.2, §2\.11\)/docs\/fully_shard.md, "Mixed precision")/g
s/FSDP2-NOTES\.md §2\.6\)/docs\/design.md, "Gradient division")/g
s/FSDP2-NOTES\.md §2\.12\)/docs\/fully_shard.md, "CPU offload")/g
s/\(FSDP2-NOTES\.md §2\.14\)/(docs\/checkpoint.md)/g
s/FSDP2-NOTES §2\.7:/docs\/fully_shard.md, "One step":/g

# --- DEPS-GUIDE.md: measured facts of the machines and dependencies
s/Rings \(reference\/DEPS-GUIDE\.md §2\)/Rings (docs\/design.md, "Rings")/g
s/no fresh pages are touched in a step: DEPS-GUIDE §7\)/no fresh pages are touched in a step: docs\/design.md, "Fresh memory is slow to touch")/g
s/\(DEPS-GUIDE §1\.11\)/(docs\/design.md, "UCX: dead peers and shutdown")/g
s/\(DEPS-GUIDE §1\.9, §4\)/(docs\/design.md, "UCX: fork")/g
s/DEPS-GUIDE §3\.2 tells why each/docs\/design.md, "The launcher", tells why each/g
s/DEPS-GUIDE §1\.4, §1\.10, §1\.12, §5:/docs\/design.md, "UCX: transports and registration":/g
s/\(transport\.h; reference\/DEPS-GUIDE\.md §1\)/(transport.h; docs\/design.md, "UCX: transports and registration" and the sections after it)/g
s/\(reference\/DEPS-GUIDE\.md §7\)/(docs\/design.md, "Thread counts, and PyTorch at its fastest")/g
s/\(reference\/DEPS-GUIDE\.md section 7\)/(docs\/design.md, "Thread counts, and PyTorch at its fastest")/g
s/^( \*[ ]+)DEPS-GUIDE §7\), the best/\1docs\/design.md, "Thread counts, and PyTorch at its fastest"), the best/
s/all_reduce \(DEPS-GUIDE §7\)/all_reduce (docs\/design.md, "Thread counts, and PyTorch at its fastest")/g
