"""Finding the CUDA runtime torch loaded, from a process's mappings (no GPU needed)."""

from ucm_ray.transport.cudart import loaded_runtime

LIBC = "7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


def test_the_runtime_is_found_under_its_usual_and_renamed_names():
    wheel = "/site packages/nvidia/cuda_runtime/lib/libcudart.so.12"  # a path with a space
    assert loaded_runtime([LIBC, f"7f1-7f2 r-xp 00000000 08:01 9 {wheel}\n"]) == wheel
    renamed = "/opt/torch/lib/libcudart-9335f6a2.so.12"
    assert loaded_runtime([LIBC, f"7f1-7f2 r-xp 00000000 08:01 9 {renamed} (deleted)\n"]) == renamed


def test_no_runtime_among_the_mappings_is_none():
    assert loaded_runtime([LIBC, "7f1-7f2 rw-p 00000000 00:00 0 [heap]\n",
                           "7f3-7f4 r-xp 00000000 08:01 9 /opt/lib/libcudnn.so.9\n"]) is None
