"""The C++ CPU kernels are built with -march=native, so their cached build is
named per instruction set (engine/kernels/cpu_kernels.extension_name)."""

from __future__ import annotations

from engine.kernels.cpu_kernels import extension_name

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\n"
ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2 avx512f avx512bw\n"


def test_cpus_with_different_instruction_sets_get_different_builds():
    assert extension_name(ZEN3) != extension_name(ZEN4)


def test_the_name_depends_on_the_flags_not_on_their_order_or_the_rest_of_cpuinfo():
    reordered = "processor\t: 0\nmodel name\t: other\nflags\t\t: bmi2 fma avx2 avx sse2 sse fpu\n"
    assert extension_name(reordered) == extension_name(ZEN3)
    assert extension_name(ZEN3 + "processor\t: 1\nflags\t\t: fpu\n") == extension_name(ZEN3)


def test_arm_features_line_counts_as_the_flags():
    neon = "processor\t: 0\nFeatures\t: fp asimd evtstrm\n"
    sve = "processor\t: 0\nFeatures\t: fp asimd evtstrm sve\n"
    assert extension_name(neon) != extension_name(sve)


def test_this_machine_gets_a_stable_valid_module_name():
    name = extension_name()
    assert name.startswith("pdserve_cpu_kernels_") and name.isidentifier()


def test_the_name_changes_with_the_source_so_versions_never_share_a_build(monkeypatch):
    from engine.kernels import cpu_kernels
    before = extension_name()
    monkeypatch.setattr(cpu_kernels, "_SOURCE", cpu_kernels._SOURCE + "\n// another version\n")
    assert extension_name() != before


def test_a_lock_left_by_a_build_that_was_killed_does_not_hang_the_next_engine(tmp_path, monkeypatch):
    """torch's build lock file outlives a process killed mid-build, and torch
    waits for it for ever: it is removed under pdserve's own build lock first."""
    import torch.utils.cpp_extension as cpp_extension

    from engine.kernels import cpu_kernels
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = tmp_path / extension_name() / "lock"
    stale.parent.mkdir()
    stale.write_text("")                       # torch's lock file of a build that was killed
    seen = []

    def load_inline(**kwargs):
        seen.append((kwargs["build_directory"], stale.exists()))
        return "the module"

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    assert cpu_kernels._build() == "the module"
    assert seen == [(str(stale.parent), False)]
