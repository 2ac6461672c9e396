"""bench/cpu_profile.py's categories: each kind of work ``perf report`` names lands where its
table says, whatever other pattern its symbol also matches."""

from __future__ import annotations

import pytest

from bench.cpu_profile import category, datapath_symbols, shares

REPORT = """\
# Samples: 15K of event 'cpu-clock'
#
    18.24%  libIPSec_MB.so.1.3.0                     [.] imb_aes_gmac_update_128_vaes_avx512
    16.61%  [kernel.kallsyms]                        [k] _copy_from_iter
    10.93%  [kernel.kallsyms]                        [k] _copy_to_iter
     7.43%  libc.so.6                                [.] __memmove_avx512_unaligned_erms
     5.00%  [kernel.kallsyms]                        [k] pv_native_safe_halt
     3.66%  libpython3.11.so.1.0                     [.] _PyEval_EvalFrameDefault
     2.52%  _datapath.cpython-311-x86_64-linux-gnu.so  [.] 0x000000000002ad61
     2.00%  libtorch_cpu.so                          [.] gloo::sum<float>
     1.42%  [kernel.kallsyms]                        [k] _raw_spin_unlock_irqrestore
     0.50%  [kernel.kallsyms]                        [k] __ip_append_data
     0.40%  [kernel.kallsyms]                        [k] __free_frozen_pages
     0.38%  [kernel.kallsyms]                        [k] do_syscall_64
     0.30%  [kernel.kallsyms]                        [k] something_else
     0.20%  libc.so.6                                [.] malloc
"""


@pytest.mark.parametrize("line, want", [
    ("libIPSec_MB.so.1.3.0 [.] imb_aes_gmac_update_128_vaes_avx512", "tag (MAC, AES-GCM)"),
    ("libcrypto.so.3 [.] aesni_gcm_encrypt", "tag (MAC, AES-GCM)"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] "
     "dlcp::(anonymous namespace)::vaes256::mac_from(unsigned char const*, dlcp::MacPart const*, unsigned long, "
     "unsigned char*)",
     "tag (MAC, AES-GCM)"),
    ("[kernel.kallsyms] [k] _copy_from_iter", "kernel copies"),
    ("[kernel.kallsyms] [k] _copy_to_iter", "kernel copies"),
    ("libc.so.6 [.] __memmove_avx512_unaligned_erms", "memcpy (libc)"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] 0x000000000002ad61", "DLCP compiled path"),
    # with its symbols (a RelWithDebInfo build) the compiled path's sums are a row of their own
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] dlcp::(anonymous namespace)::add_avx2<false, false>",
     "DLCP sums (compiled)"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] dlcp::add_bf16_sum(unsigned short*, unsigned char const*, "
     "unsigned int)", "DLCP sums (compiled)"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] dlcp::Datapath::ingest_one", "DLCP compiled path"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] dlcp::Datapath::send_credits", "DLCP compiled path"),
    ("_datapath.cpython-311-x86_64-linux-gnu.so [.] dlcp::Datapath::add_peer(unsigned short, std::string const&, "
     "unsigned short)", "DLCP compiled path"),  # (an add_ that is no sum)
    ("libtorch_cpu.so [.] gloo::sum<float>", "gloo / torch"),
    ("libpython3.11.so.1.0 [.] _PyEval_EvalFrameDefault", "Python"),
    ("[kernel.kallsyms] [k] udp_recvmsg", "network stack"),
    ("[kernel.kallsyms] [k] __ip_append_data", "network stack"),  # (not "memory": no "page" in it)
    ("[kernel.kallsyms] [k] skb_release_data", "network stack"),
    ("[kernel.kallsyms] [k] sk_page_frag_refill", "network stack"),
    ("[kernel.kallsyms] [k] finish_task_switch.isra.0", "scheduling, wake-ups"),  # ("sk" only as a whole part)
    ("[kernel.kallsyms] [k] _raw_spin_unlock_irqrestore", "scheduling, wake-ups"),
    ("[kernel.kallsyms] [k] do_epoll_wait", "scheduling, wake-ups"),
    ("[kernel.kallsyms] [k] __free_frozen_pages", "memory (pages)"),
    ("[kernel.kallsyms] [k] do_syscall_64", "system calls"),
    ("[kernel.kallsyms] [k] pv_native_safe_halt", "idle"),
    ("[kernel.kallsyms] [k] something_else", "other kernel"),
    ("[kernel.kallsyms] [k] __list_del_entry_valid_or_report", "other kernel"),
    ("libc.so.6 [.] malloc", "other user"),
])
def test_each_kind_of_work_lands_in_its_category(line, want):
    assert category(line) == want


def test_shares_add_up_per_category_and_skip_the_header():
    got = shares(REPORT)
    assert got["tag (MAC, AES-GCM)"] == pytest.approx(0.1824)
    assert got["kernel copies"] == pytest.approx(0.1661 + 0.1093)
    assert got["idle"] == pytest.approx(0.05)
    assert got["other user"] == pytest.approx(0.002)
    assert sum(got.values()) == pytest.approx(sum(float(x.split("%")[0]) for x in REPORT.splitlines()[2:]) / 100)


def test_it_tells_whether_the_compiled_path_kept_its_symbols(tmp_path, monkeypatch):
    """A module whose symbols name the tag's function counts as a build with symbols; one
    without them (stripped, or not an object file at all) does not."""
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess

    if not (shutil.which("nm") and shutil.which("cc")):
        pytest.skip("needs nm and cc (binutils, a C compiler)")
    src = tmp_path / "m.c"
    src.write_text("void mac_from(void) {}\n")
    with_symbols = tmp_path / "with.o"
    subprocess.run(["cc", "-c", str(src), "-o", str(with_symbols)], check=True)
    stripped = tmp_path / "stripped.o"
    src.write_text("static int unused;\n")
    subprocess.run(["cc", "-c", str(src), "-o", str(stripped)], check=True)
    not_object = tmp_path / "text.so"
    not_object.write_text("mac_from")

    def module_at(path):
        return lambda name: importlib.machinery.ModuleSpec(name, None, origin=str(path))

    for path, want in [(with_symbols, True), (stripped, False), (not_object, False)]:
        monkeypatch.setattr(importlib.util, "find_spec", module_at(path))
        assert datapath_symbols() is want, path
