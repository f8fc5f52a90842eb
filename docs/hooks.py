"""MkDocs hooks: the pages made from the repository itself at build time, so that they cannot
drift from it. The landing page is README.md; the command-line reference is the parsers' own
help; the API reference lists the package's public names; the results pages are the generated
RESULTS.md files with their figures."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("align", "merge", "convert-config", "inspect", "barrier", "demo")

# The API reference's sections: the public names of `rotsym_jax/__init__.py` by what they are for.
API_SECTIONS = {
    "Aligning": ["align", "AlignResult", "AlignOptions", "align_many", "ManyResult", "distance_report",
                 "fold_norms", "random_residual", "fold_latents", "random_latent_rotations", "transform_opt_state"],
    "Checkpoints": ["load_hf", "save_hf", "init_checkpoint", "Checkpoint", "spec_for", "untie", "load_orbax",
                    "save_orbax", "save_config", "infer_record", "InferredRecord"],
    "Whole runs": ["align_checkpoints", "merge_checkpoints", "merge_mergekit", "moe_to_disk", "RunOptions", "MergeOptions", "StreamOptions"],
    "Specs and transforms": ["Spec", "bind", "BoundSpec", "HeadGeometry", "ResidualSpec", "apply_transform",
                             "HeadTransform", "ResidualTransform", "UnitPermutation", "identity_transform",
                             "random_transform", "compose_transforms", "invert_transform"],
    "Errors": ["RotsymError", "InputError", "SpecError", "CheckpointError"],
}
API_MODULES = ("merge", "stats", "otfusion", "streaming", "barrier", "plots", "recipe", "mergekit")


def _package_maps() -> tuple[dict, dict]:
    """`_EXPORTS` and `_MODULES` of rotsym_jax/__init__.py, read without importing it."""
    tree = ast.parse((ROOT / "rotsym_jax" / "__init__.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("_EXPORTS", "_MODULES"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["_EXPORTS"], found["_MODULES"]


def api_page() -> str:
    exports, modules = _package_maps()
    listed = [name for names in API_SECTIONS.values() for name in names]
    missing = sorted(set(exports) - set(listed))
    if missing:  # a new public name must find its section here
        raise ValueError(f"docs/hooks.py: API_SECTIONS lacks the public names {missing}")
    lines = ["# API reference", "",
             "Every public name is `rotsym_jax.<name>` (`import rotsym_jax as rj`), and each public module",
             "is imported by its short name (`from rotsym_jax import merge`), wherever it lives.", ""]
    for section, names in API_SECTIONS.items():
        lines += [f"## {section}", ""]
        for name in names:
            lines += [f"::: rotsym_jax.{exports[name]}.{name}", "    options:", f"      heading: rj.{name}", f"      toc_label: rj.{name}",
                      "      show_root_full_path: false", ""]
    lines += ["## Modules", ""]
    for short in API_MODULES:
        lines += [f"::: rotsym_jax.{modules[short] if short in modules else short}", "    options:",
                  f"      heading: rotsym_jax.{short}", f"      toc_label: rotsym_jax.{short}", "      members_order: source", ""]
    return "\n".join(lines)


def cli_page() -> str:
    from rotsym_jax.cli import parsers

    os.environ["COLUMNS"] = "100"  # argparse wraps the help at the terminal's width
    parser, commands = parsers.build_parser()
    lines = ["# Command-line reference", "", "The help of each `rotsym` command, as the command prints it.", "",
             "## rotsym", "", "```text", parser.format_help().rstrip(), "```", ""]
    for command in COMMANDS:
        lines += [f"## rotsym {command}", "", "```text", commands.choices[command].format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def options_page() -> str:
    from rotsym_jax.options import options_table

    return "\n".join(["# Alignment options", "",
                      "Every option of `align` (`AlignOptions`), declared once in `rotsym_jax/options.py`: the checks, the recipe "
                      "keys, the flags and what a report records come from the same declaration. A report records each option its "
                      "method reads, as it ran (\"auto\" settled), and its recipe replays it; the last column is the flag's help, "
                      "and `help(rj.AlignOptions)` says more.", "", options_table(), ""])


def _results(kind: str) -> tuple[str, list[str]]:
    text = (ROOT / kind / "RESULTS.md").read_text()
    figures = re.findall(r"\]\((results/[^)]+\.png)\)", text)
    text = re.sub(r"\]\(results/", f"]({kind}/", text)
    text = text.replace("](../experiments/RESULTS.md)", "](experiments.md)").replace("](../benchmarks/RESULTS.md)", "](benchmarks.md)")
    return text, figures


def landing_page() -> str:
    """README.md, its links into docs/ made relative to the site."""
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)
    text = re.sub(r"\]\(notebooks/", "](tutorials/", text)  # docs/tutorials links to them
    text = re.sub(r"\]\((experiments|benchmarks)/RESULTS\.md\)", r"](results/\1.md)", text)
    return text


def on_files(files, config):
    pages = {"index.md": landing_page(), "reference/api.md": api_page(), "reference/cli.md": cli_page(), "reference/options.md": options_page()}
    for kind in ("experiments", "benchmarks"):
        text, figures = _results(kind)
        pages[f"results/{kind}.md"] = text
        for figure in figures:
            files.append(File.generated(config, f"results/{kind}/{figure.removeprefix('results/')}",
                                        abs_src_path=str(ROOT / kind / figure)))
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    return files
