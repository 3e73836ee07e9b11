"""`environment.json`: the kit's source fingerprint follows the code, not the version number."""

from pathlib import Path

from mhar_lightning.run_environment import kit_folders, source_fingerprint


def test_the_source_fingerprint_changes_with_any_file_and_only_then(tmp_path: Path) -> None:
    package, kernels = tmp_path / "pkg", tmp_path / "kernels"
    for folder, text in ((package, "a = 1\n"), (kernels / "sub", "b = 2\n")):
        folder.mkdir(parents=True)
        (folder / "m.py").write_text(text)
    (package / "notes.txt").write_text("not code")
    first = source_fingerprint([package, kernels])
    assert source_fingerprint([package, kernels]) == first and len(first) == 12
    (package / "notes.txt").write_text("still not code")
    assert source_fingerprint([package, kernels]) == first
    (kernels / "sub" / "m.py").write_text("b = 3\n")
    assert source_fingerprint([package, kernels]) != first
    (kernels / "sub" / "m.py").write_text("b = 2\n")
    (kernels / "sub" / "m.py").rename(kernels / "sub" / "n.py")  # same content, another module
    assert source_fingerprint([package, kernels]) != first


def test_the_kit_folders_hold_its_three_packages() -> None:
    names = {Path(folder).name for folder in kit_folders()}
    assert {"kernels", "callbacks"} <= names and len(kit_folders()) == 3
