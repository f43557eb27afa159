"""Cause extraction from a rank's stderr tail and exit status, on tracebacks copied from real runs."""

from __future__ import annotations

import json
import signal

from supervisor.core.causes import LIBRARY_DIRS, Cause, CauseKind, explain, explain_exit, oom_kill_count

LIBS = ("/usr/lib/python3.11", "/opt/tw/worker")  # stands in for the stdlib and trainwarden's worker package

RAISE_AT_STEP = b"""\
Traceback (most recent call last):
  File "/home/u/proj/train.py", line 15, in <module>
    step(n)
  File "/home/u/proj/train.py", line 6, in step
    raise ValueError(f"boom at {n}")
ValueError: boom at 40
"""

# The innermost frames are the standard library's: the user's frame is the one that called it.
STDLIB_INNERMOST = b"""\
Traceback (most recent call last):
  File "/home/u/proj/p2.py", line 4, in <module>
    load("{bad")
  File "/home/u/proj/p2.py", line 3, in load
    return json.loads(text)
           ^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads
    return _default_decoder.decode(s)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/usr/lib/python3.11/json/decoder.py", line 353, in raw_decode
    obj, end = self.scan_once(s, idx)
               ^^^^^^^^^^^^^^^^^^^^^^
json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
"""

CHAINED = b"""\
Traceback (most recent call last):
  File "/home/u/proj/p3.py", line 5, in outer
    inner()
  File "/home/u/proj/p3.py", line 2, in inner
    return {}["missing"]
           ~~^^^^^^^^^^^
KeyError: 'missing'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/home/u/proj/p3.py", line 8, in <module>
    outer()
  File "/home/u/proj/p3.py", line 7, in outer
    raise RuntimeError("config lookup failed") from exc
RuntimeError: config lookup failed
"""

# torch.save onto a full tmpfs: the ENOSPC is the chained exception, the final one is torch's.
TORCH_SAVE_DISK_FULL = b"""\
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 1003, in save
    _save(
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 1312, in _save
    zip_file.write_record(name, storage, num_bytes)
OSError: [Errno 28] No space left on device

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/tmp/fill.py", line 5, in <module>
    save()
  File "/tmp/fill.py", line 4, in save
    torch.save({"w": torch.zeros(100000)}, f)
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 1002, in save
    with _open_zipfile_writer(f) as opened_zipfile:
  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 854, in __exit__
    self.file_like.write_end_of_file()
RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598
"""

# Resuming through the worker library into a model whose shapes changed.
STATE_DICT_MISMATCH = b"""\
/venv/lib/python3.11/site-packages/torch/_subclasses/functional_tensor.py:368: UserWarning: Failed to initialize NumPy
  cpu = _conversion_method_template(device=torch.device("cpu"))
Traceback (most recent call last):
  File "/home/u/proj/train.py", line 30, in <module>
    start = warden.resume()
  File "/opt/tw/worker/warden.py", line 146, in resume
    self.model.load_state_dict(state["model"])
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 2638, in load_state_dict
    raise RuntimeError(
RuntimeError: Error(s) in loading state_dict for Linear:
\tsize mismatch for weight: copying a param with shape torch.Size([4, 8]) from checkpoint, the shape in current \
model is torch.Size([2, 8]).
\tsize mismatch for bias: copying a param with shape torch.Size([4]) from checkpoint, the shape in current model is \
torch.Size([2]).
"""

# An uncaught exception with torch.distributed initialised: torch puts the rank before every line.
DDP_PREFIXED = b"""\
/venv/lib/python3.11/site-packages/torch/_subclasses/functional_tensor.py:368: UserWarning: Failed to initialize NumPy
  cpu = _conversion_method_template(device=torch.device("cpu"))
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/why/train.py", line 25, in <module>
[rank1]:     x, y = load_batch(warden.batches)
[rank1]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank1]:   File "/tmp/why/train.py", line 13, in load_batch
[rank1]:     raise ValueError(f"shard 7 is truncated at batch {index}")
[rank1]: ValueError: shard 7 is truncated at batch 42
"""

MISSING_KEYS = b"""\
Traceback (most recent call last):
  File "/tmp/sd2.py", line 4, in <module>
    b.load_state_dict(a.state_dict())
  File "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 2638, in load_state_dict
    raise RuntimeError(
RuntimeError: Error(s) in loading state_dict for Sequential:
\tMissing key(s) in state_dict: "1.weight", "1.bias".
"""


def test_traceback_gives_final_exception_and_innermost_user_frame():
    """A script raising at a step is named by its exception line and the frame that raised it."""
    cause = explain(RAISE_AT_STEP, 1, library_dirs=LIBS)
    assert cause == Cause(
        CauseKind.EXCEPTION, "ValueError: boom at 40 (train.py:6 in step)", "ValueError (train.py:6 in step)"
    )
    assert (cause.retryable, cause.repeatable, cause.breakable) == (True, True, True)


def test_torch_distributed_rank_prefix_is_read_through():
    """The `[rank1]: ` torch.distributed puts before each line is dropped: the same cause on every rank."""
    cause = explain(DDP_PREFIXED, 1, library_dirs=LIBS)
    assert cause.text == "ValueError: shard 7 is truncated at batch 42 (train.py:13 in load_batch)"
    assert explain(DDP_PREFIXED.replace(b"[rank1]", b"[rank0]"), 1, library_dirs=LIBS) == cause


def test_frames_in_the_standard_library_are_not_the_users_code():
    """The innermost frame outside the standard library is named, not json's decoder."""
    cause = explain(STDLIB_INNERMOST, 1, library_dirs=LIBS)
    assert cause.text == (
        "json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1) (p2.py:3 in load)"
    )


def test_chained_traceback_is_named_by_its_final_exception():
    """Of exceptions chained with 'from', the final one is the cause."""
    cause = explain(b"some earlier output\n" + CHAINED, 1, library_dirs=LIBS)
    assert cause.text == "RuntimeError: config lookup failed (p3.py:7 in outer)"


def test_same_exception_type_at_same_line_is_the_same_cause_despite_its_message():
    """Two failures differing only in the message (a size, a name) compare the same; another line does not."""
    other_message = explain(RAISE_AT_STEP.replace(b"boom at 40", b"boom at 41"), 1, library_dirs=LIBS)
    other_line = explain(RAISE_AT_STEP.replace(b"line 6", b"line 7"), 1, library_dirs=LIBS)
    first = explain(RAISE_AT_STEP, 1, library_dirs=LIBS)
    assert first.same_as == other_message.same_as != other_line.same_as


def test_no_space_left_in_a_chained_exception_is_disk_full():
    """ENOSPC anywhere in the exception chain (torch.save re-raises it as RuntimeError) is 'disk full'."""
    cause = explain(TORCH_SAVE_DISK_FULL, 1, library_dirs=LIBS)
    assert cause == Cause(
        CauseKind.DISK_FULL,
        "disk full: OSError: [Errno 28] No space left on device (fill.py:4 in save)",
        "disk full (fill.py:4 in save)",
    )
    assert cause.retryable and cause.repeatable


def test_disk_full_key_ignores_the_varying_file_name():
    """Two ENOSPC errors on different temporary files are the same cause."""

    def full(name: bytes) -> Cause:
        return explain(
            b'Traceback (most recent call last):\n  File "/p/t.py", line 9, in save\n    f.write(b)\n'
            b"OSError: [Errno 28] No space left on device: '/ckpt/." + name + b".tmp'\n",
            1,
            library_dirs=LIBS,
        )

    assert full(b"a1b2").same_as == full(b"c3d4").same_as == "disk full (t.py:9 in save)"
    assert full(b"a1b2").text == (
        "disk full: OSError: [Errno 28] No space left on device: '/ckpt/.a1b2.tmp' (t.py:9 in save)"
    )


def test_no_space_left_without_traceback_is_disk_full():
    """A program that is not Python saying ENOSPC on its last lines is 'disk full' too."""
    cause = explain(b"writing shard 3\ncp: error writing 'out/shard3': No space left on device\n", 1)
    assert cause.kind is CauseKind.DISK_FULL
    assert cause.text == "disk full: cp: error writing 'out/shard3': No space left on device (exited with code 1)"


def test_state_dict_size_mismatch_is_an_incompatible_checkpoint_not_retried():
    """A load_state_dict size mismatch names the first mismatch and the user's resume call; no retry."""
    cause = explain(STATE_DICT_MISMATCH, 1, library_dirs=LIBS)
    assert cause.kind is CauseKind.CHECKPOINT_INCOMPATIBLE
    assert cause.text == (
        "checkpoint incompatible with the model: RuntimeError: Error(s) in loading state_dict for "
        "Linear: size mismatch for weight: copying a param with shape torch.Size([4, 8]) from "
        "checkpoint, the shape in current model is torch.Size([2, 8]). (train.py:30 in <module>)"
    )
    assert not cause.retryable


def test_state_dict_missing_keys_is_an_incompatible_checkpoint():
    """Missing keys in a state_dict are recognised like a size mismatch."""
    cause = explain(MISSING_KEYS, 1, library_dirs=LIBS)
    assert cause.text == (
        "checkpoint incompatible with the model: RuntimeError: Error(s) in loading state_dict for "
        'Sequential: Missing key(s) in state_dict: "1.weight", "1.bias". (sd2.py:4 in <module>)'
    )


def test_traceback_the_rank_survived_is_not_its_cause():
    """A traceback printed and survived (logged, then training went on) does not explain a later exit."""
    logs = b"".join(b"step %d loss 0.5\n" % step for step in range(20))
    cause = explain(
        STATE_DICT_MISMATCH + b"starting from scratch instead\n" + logs + b"fatal: lost shard 3\n", 3, library_dirs=LIBS
    )
    assert cause == Cause(CauseKind.EXIT, "exited with code 3: fatal: lost shard 3")


def test_teardown_lines_after_the_traceback_keep_it_the_cause():
    """A few lines after the traceback (warnings while the interpreter shuts down) leave it the cause."""
    teardown = b"[W1123 10:26:17.099 ProcessGroupGloo.cpp:1168] Warning: process group has NOT been destroyed\n"
    assert explain(RAISE_AT_STEP + teardown * 2, 1, library_dirs=LIBS).kind is CauseKind.EXCEPTION


def test_exit_without_traceback_names_the_code_and_the_last_line():
    """A plain non-zero exit is its code and the last thing the rank wrote, or the code alone."""
    assert explain(b"loading\nerror: dataset shard 7 missing\n\n", 3).text == (
        "exited with code 3: error: dataset shard 7 missing"
    )
    assert explain(b"", 7) == explain_exit(7) == Cause(CauseKind.EXIT, "exited with code 7")


def test_exit_78_is_a_config_error_not_retried():
    """A rank's exit 78 (its settings are invalid) is not retryable, with the worker's one-line error."""
    cause = explain(b"trainwarden: worker config error: 'prefix' must be a string\n", 78)
    assert cause == Cause(
        CauseKind.CONFIG, "exited with code 78: trainwarden: worker config error: 'prefix' must be a string"
    )
    assert not cause.retryable


def test_signal_is_named_and_never_the_scripts_repeatable_doing():
    """A kill is named by its signal; it counts toward 'no progress' but never makes two failures 'the same'."""
    cause = explain(RAISE_AT_STEP, -signal.SIGKILL, library_dirs=LIBS)
    assert cause == Cause(CauseKind.SIGNAL, "killed by SIGKILL")
    assert (cause.retryable, cause.repeatable, cause.breakable) == (True, False, True)


def test_sigkill_while_the_oom_killer_struck_says_out_of_memory():
    """A SIGKILL during an attempt in which the cgroup's OOM-kill count rose is called out of memory."""
    cause = explain(b"", -signal.SIGKILL, oom_killed=True)
    assert cause.kind is CauseKind.OOM and cause.repeatable
    assert cause.text == "killed by SIGKILL (out of memory: the kernel's OOM killer struck during the attempt)"
    assert explain(b"", -signal.SIGTERM, oom_killed=True).text == "killed by SIGTERM"


def test_oom_kill_count_reads_cgroup_v1_and_v2_files():
    """The `oom_kill` line of memory.events (v2) and memory.oom_control (v1) is read; absent is None."""
    assert oom_kill_count("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n") == 2
    assert oom_kill_count("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5
    assert oom_kill_count("oom_kill_disable 0\nunder_oom 0\n") is None


def test_hostile_stderr_gives_one_bounded_printable_line():
    """Control characters, invalid UTF-8 and a huge message come out as one printable line of bounded length."""
    junk = b'Traceback (most recent call last):\n  File "/p/t.py", line 1, in f\nValueError: \x1b[31m\xff' + b"x" * 5000
    cause = explain(junk, 1, library_dirs=LIBS)
    assert cause.text.isprintable() and len(cause.text) <= 300
    assert cause.text.startswith("ValueError:") and cause.text.endswith("xxx... (t.py:1 in f)")


def test_traceback_cut_off_before_its_exception_line_still_gives_a_cause():
    """A tail ending inside the frames (the rank was killed mid-write) still yields an exception cause."""
    cause = explain(
        b'Traceback (most recent call last):\n  File "/p/t.py", line 3, in f\n    g()\n', 1, library_dirs=LIBS
    )
    assert cause.text == "a Python exception (its message was cut off) (t.py:3 in f)"


def test_default_library_dirs_hold_the_standard_library_and_the_worker_package():
    """Without `library_dirs`, the real standard library and trainwarden's worker package are not user code."""
    trace = (
        'Traceback (most recent call last):\n  File "/home/u/t.py", line 2, in main\n    go()\n'
        f'  File "{json.__file__}", line 346, in loads\n    x\n'
        f'  File "{LIBRARY_DIRS[-1]}/warden.py", line 9, in resume\n    y\nValueError: z\n'
    ).encode()
    assert explain(trace, 1).text == "ValueError: z (t.py:2 in main)"


GLOO_ABORT = b"""\
  ddp = DistributedDataParallel(model, broadcast_buffers=False)  # the only buffer is a constant mask
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] op.preamble.length \
<= op.nbytes. 16 vs 8. Received data size doesn't match expected size. Is there a distributed collective mismatch in \
your code?
"""
GLOO_PEER_GONE = b"""\
[rank0]:   File "/v/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error \
[127.0.0.1]:49353: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the \
application.
"""


def test_a_gloo_abort_on_a_size_mismatch_is_a_desync_not_just_a_signal():
    """Recorded from a rank of a desynced job: gloo's C++ abort says what happened; the SIGABRT alone does not."""
    cause = explain(GLOO_ABORT, -signal.SIGABRT, library_dirs=LIBS)
    assert cause.kind is CauseKind.COLLECTIVE and cause.repeatable
    assert cause.text == (
        "desync: Received data size doesn't match expected size. Is there a distributed collective "
        "mismatch in your code? (killed by SIGABRT)"
    )


def test_a_collective_that_failed_because_a_peer_went_away_is_a_collective_failure():
    cause = explain(GLOO_PEER_GONE, 1, library_dirs=LIBS)
    assert cause.kind is CauseKind.COLLECTIVE and cause.text.startswith("collective failed: RuntimeError: [")
    assert cause.same_as == "collective failed (exited with code 1)"


def test_a_rank_killed_from_outside_is_a_signal_whatever_its_stderr_said():
    """SIGKILL (an operator, the OOM killer) is not the collective's doing, even after such a line."""
    assert explain(GLOO_PEER_GONE, -signal.SIGKILL, library_dirs=LIBS).kind is CauseKind.SIGNAL


# Two ranks given one GPU (torch 2.4, NCCL 2.20), as torch.distributed prints it.
NCCL_DUPLICATE_GPU = b"""\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/u/proj/train.py", line 60, in main
[rank1]:     model = DDP(model, device_ids=[local_rank])
[rank1]:   File "/v/site-packages/torch/distributed/utils.py", line 288, in _verify_param_shape_across_processes
[rank1]:     return dist._verify_params_across_processes(process_group, tensors, logger)
[rank1]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, \
invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.20.5
[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
[rank1]: Last error:
[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000
"""
# Another misuse, from an older torch (no hint in parentheses) with C++ frames after it.
NCCL_OTHER_MISUSE = (
    b"torch.distributed.DistBackendError: NCCL error in: /opt/pytorch/torch/csrc/distributed/c10d/"
    b"ProcessGroupNCCL.cpp:1287, invalid usage, NCCL version 2.17.1\n"
    b"ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    b"Last error:\n"
    b"Invalid config blocking attribute value -2147483648\n"
    b"Exception raised from getNCCLComm at /opt/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1287\n"
    + b"".join(b"frame #%d: c10::Error::Error() + 0x%x\n" % (i, i) for i in range(30))
)


def test_nccl_duplicate_gpu_is_a_config_error_naming_the_ranks_not_retried():
    """NCCL's invalid usage for two ranks on one GPU is not retryable; the cause is the line naming them."""
    cause = explain(NCCL_DUPLICATE_GPU, 1, library_dirs=LIBS)
    assert cause == Cause(
        CauseKind.CONFIG,
        "NCCL invalid usage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000 (exited with code 1)",
        "NCCL invalid usage (exited with code 1)",
    )
    assert not cause.retryable


def test_nccl_invalid_usage_names_its_last_error_whether_raised_or_aborted():
    """Any other misuse NCCL reports is named by the line after its "Last error:", an abort included."""
    for returncode, how in ((1, "exited with code 1"), (-signal.SIGABRT, "killed by SIGABRT")):
        cause = explain(NCCL_OTHER_MISUSE, returncode, library_dirs=LIBS)
        assert cause.kind is CauseKind.CONFIG and not cause.retryable
        assert cause.text == f"NCCL invalid usage: Invalid config blocking attribute value -2147483648 ({how})"


def test_nccl_debug_warning_of_a_duplicate_gpu_is_named_without_its_log_prefix():
    """NCCL_DEBUG=WARN's own line ("host:pid:tid [0] init.cc:497 NCCL WARN Duplicate GPU ...") is enough."""
    warned = (
        b"n1:29880:30398 [0] init.cc:497 NCCL WARN Duplicate GPU detected : rank 2 and rank 0 both on CUDA device 0\n"
    )
    assert explain(warned, 1).text == (
        "NCCL invalid usage: Duplicate GPU detected : rank 2 and rank 0 both on CUDA device 0 (exited with code 1)"
    )


def test_a_rank_killed_from_outside_after_nccl_misuse_is_a_signal():
    """SIGKILL is not NCCL's doing, whatever the rank wrote before it."""
    assert explain(NCCL_DUPLICATE_GPU, -signal.SIGKILL, library_dirs=LIBS).kind is CauseKind.SIGNAL
