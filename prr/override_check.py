"""The command line's overrides composed before Hydra runs anything, so that a misspelled group
option or key is refused in one line that names it, the valid names and the closest one.
Hydra reports these itself in several lines (a traceback for some), and in a sweep only when
the bad job's turn comes, after the jobs before it have run.

Each job that a sweep's group options produce is composed once: every override at its first
value, then each other value of a swept group alone; the other combinations of the groups'
options take those jobs' group nodes (where an option sets only its own node), and every
combination of the swept keys' values is set in each job's config as Hydra sets a key. So prr's
validation checks every job of the sweep, values that clash only together included, before job 0
runs; hydra_plugins/prr_resume checks every job again, composed by Hydra, before launching one."""

from __future__ import annotations

import copy
import difflib
import itertools
import math
from pathlib import Path
from typing import Any, NoReturn

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.config_loader import ConfigLoader
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

SEARCHPATH = "hydra.searchpath"  # Hydra's key for config dirs searched beside the primary one


class BadOverride(ValueError):
    """A command-line override that does not compose; the message is one line."""


def check_command_line(argv: list[str], conf_dir: Path, config_name: str) -> list[DictConfig] | None:
    """Raise BadOverride for the first override of argv (run.py's arguments) that Hydra would refuse.
    Returns the jobs' configs as composed (module docstring; with their `hydra` node), or None
    when argv asks for Hydra's help or information, or names another config dir."""
    parser = get_args_parser()  # Hydra's own: what it refuses, Hydra would refuse with its usage text
    parser.error = refuse_arguments  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    modes = [flag for flag, on in (("-m", args.multirun), ("--cfg", args.cfg), ("--info", args.info),
                                   ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:  # Hydra raises a ValueError (a traceback) for these
        what = "print a job's config" if args.cfg else "show information"
        raise BadOverride(f"{' and '.join(modes)} cannot go together: Hydra runs one mode at a time; to {what}, "
                          "drop -m and give each swept override one value (selector=quest,exact -> selector=quest); "
                          f"to run the sweep, drop {modes[1]}")
    if args.help or args.hydra_help or args.info or args.shell_completion or args.experimental_rerun:
        return None  # Hydra's help and information, as Hydra prints them; a rerun takes a pickled config, not argv
    if args.config_path or args.config_dir:
        return None  # another config dir than conf_dir: Hydra reports what does not compose there
    return check_overrides(args.overrides, conf_dir, args.config_name or config_name, multirun=args.multirun)


def refuse_arguments(message: str) -> NoReturn:
    """argparse's error, one line instead of its usage text."""
    if message.startswith("unrecognized arguments"):  # `a=1 -m b=2`: argparse takes no overrides after a flag
        message += "; flags such as -m go before or after the overrides, not among them"
    raise BadOverride(f"{message} (python run.py --hydra-help lists the flags)")


def check_overrides(overrides: list[str], conf_dir: Path, config_name: str, multirun: bool) -> list[DictConfig]:
    """The composed configs of the jobs (module docstring), or BadOverride."""
    if GlobalHydra.instance().is_initialized():  # a caller's Hydra (tests, tools): this check composes its own
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir.absolute()), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = config_groups(loader)
        parsed = parse(overrides, loader)
        top_keys = top_level_keys(conf_dir / f"{config_name}.yaml", groups)
        for override in parsed:
            if override.is_sweep_override() and not multirun:
                raise BadOverride(sweep_without_multirun(override, groups))
            if override.key_or_group in groups and isinstance(override.value(), list):
                raise BadOverride(group_given_a_list(override))
            unread = added_unread_key(override, groups, top_keys)
            if unread:
                raise BadOverride(f"{override.input_line}: {unread}")
        jobs, key_values, group_jobs = sweep_jobs(parsed, groups, loader, config_name)
        if multirun:  # the sweeper's params from the config (experiment presets) sweep too, before argv's
            # read from the group options alone (and the dirs they come from): argv's keys may exist only
            # under the groups the params choose
            chosen = [line for line in jobs[0] if parse([line], loader)[0].key_or_group in groups | {SEARCHPATH}]
            params = OmegaConf.select(compose_job(config_name, chosen, groups), "hydra.sweeper.params")
            if params:
                preset = parse([f"{k}={v}" for k, v in params.items()], loader)
                jobs, key_values, group_jobs = sweep_jobs(preset + parsed, groups, loader, config_name)
        composed = [compose_job(config_name, job, groups) for job in jobs]
        # the other combinations of the swept groups' options, their nodes taken from the jobs composed
        # above; then every combination of the swept keys' values set in each, as Hydra sets a key
        # override (a compose costs ~80 ms on 2 cores; taking a node or setting a key, well under 1 ms)
        bases = composed + group_combinations(composed, group_jobs)
        combinations = key_combinations(key_values)
        bases = bases if len(bases) * (1 + len(combinations)) <= MAX_JOBS_CHECKED else composed[:1]
        return bases + [with_key_values(job, combination, loader) for job in bases for combination in combinations]


def sweep_without_multirun(override: Override, groups: set[str]) -> str:
    """The refusal of `selector=quest,exact` without -m, with the command that sweeps it."""
    line = override.input_line
    advice = f"{line} is a sweep: add -m (--multirun) to run one job per value (python run.py -m {line} ...)"
    if override.key_or_group in groups:  # a group takes one option per job: a list there is refused too
        return advice
    return f"{advice}, or, for one job whose value is a list, write {override.key_or_group}=[...]"


def group_given_a_list(override: Override) -> str:
    """`selector=[quest,exact]`: Hydra would merge both options into one config (the last wins)."""
    options = ",".join(str(o) for o in override.value())
    return (f"{override.input_line}: {override.key_or_group} takes one option per job, but a list chooses several, "
            f"which Hydra merges into one config (the last wins); choose one, or sweep them with "
            f"-m {override.key_or_group}={options}")


def top_level_keys(config_file: Path, groups: set[str]) -> set[str]:
    """The primary config's own keys (seed, hydra) and its config groups' (model, selector, ...)."""
    own = OmegaConf.load(config_file) if config_file.is_file() else OmegaConf.create()
    return {str(k) for k in own if k != "defaults"} | {g.split("/")[0] for g in groups}


def added_unread_key(override: Override, groups: set[str], top_keys: set[str]) -> str | None:
    """Why `+foo=1` (or `++foo=1`) is refused: it adds a top-level key that nothing in prr
    reads, so the run would go ahead as if it were not there. None for any other override
    (keys added under a group are checked against that group's class by the validation)."""
    if not (override.is_add() or override.is_force_add()) or override.key_or_group in groups:
        return None
    first = override.key_or_group.split(".")[0]
    if first in top_keys:
        return None
    close = closest(first, sorted(top_keys))
    hint = f"did you mean {close}? " if close else ""
    return (f"prr reads no top-level key {first!r}, so adding it would change nothing; {hint}"
            f"keys and groups: {', '.join(sorted(top_keys))}")


def parse(overrides: list[str], loader: ConfigLoader) -> list[Override]:
    try:
        return OverridesParser.create(config_loader=loader).parse_overrides(overrides)
    except OverrideParseException as err:  # its message lacks the override it is about
        raise BadOverride(f"{err.override}: {one_line(err)}") from None


def config_groups(loader: ConfigLoader, parent: str = "") -> set[str]:
    """Every config group in the search path: selector, model, ..., hydra/launcher, ..."""
    found = set()
    for name in loader.list_groups(parent):
        group = f"{parent}/{name}" if parent else name
        found |= {group} | config_groups(loader, group)
    return found


def sweep_jobs(parsed: list[Override], groups: set[str], loader: ConfigLoader, config_name: str
               ) -> tuple[list[list[str]], dict[str, list[str]], dict[str, list[int]]]:
    """Override lines of the jobs to compose (module docstring), each group option checked on
    the way; each swept key's lines of its values after the first (`with_key_values` sets them);
    and each swept group's jobs, [0 (its first option's), then one per other option] indices into
    the jobs. A later override of the same key replaces an earlier one, as in Hydra's basic sweeper."""
    values: dict[str, list[str]] = {}
    searchpath = searchpath_lines(parsed)
    key_values: dict[str, list[str]] = {}
    for override in parsed:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                continue  # interval(a,b) is for optimizing sweepers, which choose its values themselves
            options: list[Any] = list(override.sweep_string_iterator())
            lines = [f"{key}={option}" for option in options]
        else:
            options = [override.value()]
            lines = [override.input_line or f"{key}={override.get_value_element_as_str()}"]
        key_values.pop(key, None)
        if override.key_or_group in groups:
            for option, line in zip(options, lines, strict=True):
                if isinstance(option, list):  # a list in a sweep: `selector=[quest,exact],dense`
                    raise BadOverride(f"{line}: {override.key_or_group} takes one option per job, not a list; "
                                      f"sweep the options with -m {override.key_or_group}=a,b")
                if isinstance(option, str):  # not null or a deletion (~group)
                    check_group_option(loader, override.key_or_group, option, line, config_name, searchpath)
        else:
            lines, key_values[key] = lines[:1], lines[1:]
        values[key] = lines
    first = {key: lines[0] for key, lines in values.items()}
    jobs = [list(first.values())]
    group_jobs = {}
    for key, lines in values.items():
        if len(lines) > 1:
            group_jobs[key] = [0, *range(len(jobs), len(jobs) + len(lines) - 1)]
        jobs += [list({**first, key: line}.values()) for line in lines[1:]]
    return jobs, key_values, group_jobs


# Jobs checked before Hydra at most; beyond, the first job's own (the resume sweeper checks every job before launching one)
MAX_JOBS_CHECKED = 1024


def group_combinations(composed: list[DictConfig], group_jobs: dict[str, list[int]]) -> list[DictConfig]:
    """The jobs of every combination of two or more swept groups' other options (predictor=oracle with
    budget=profiled), each the first job with those groups' nodes taken from the jobs composed for
    their options, so that options that clash only together are refused before Hydra too. Only for
    groups whose option sets its own node alone (model, selector, ...: checked here, node by node);
    the others' combinations, and sweeps of more than MAX_JOBS_CHECKED jobs, are left to the resume
    sweeper."""
    swappable = {group: indices for group, indices in group_jobs.items()
                 if all(sets_only_its_node(composed[0], composed[i], group) for i in indices[1:])}
    if len(swappable) < 2 or math.prod(len(i) for i in swappable.values()) > MAX_JOBS_CHECKED:
        return []
    jobs = []
    for picks in itertools.product(*swappable.values()):
        chosen = [(group, index) for group, index in zip(swappable, picks, strict=True) if index]
        if len(chosen) < 2:
            continue  # the first job, or one composed above
        job = copy.deepcopy(composed[0])
        for group, index in chosen:
            job[group] = copy.deepcopy(composed[index][group])
            job.hydra.runtime.choices[group] = composed[index].hydra.runtime.choices[group]
        jobs.append(job)
    return jobs


def searchpath_lines(parsed: list[Override]) -> list[str]:
    """The command line's `hydra.searchpath=[...]`: config dirs Hydra searches beside conf/ (a
    package of your own options: docs/extending.md), whose group options compose as conf/'s do."""
    return [o.input_line for o in parsed if o.get_key_element() == SEARCHPATH and o.input_line]


def sets_only_its_node(first: DictConfig, other: DictConfig, group: str) -> bool:
    """Whether `other` (first's job with another option of `group`) differs from first only in
    the group's own node (and Hydra's record): then that node carries the option into any job."""
    if "/" in group or group not in first or group not in other:
        return False
    rest = [k for k in {*first.keys(), *other.keys()} if k not in (group, "hydra")]
    return all(k in first and k in other and OmegaConf.to_container(first[k]) == OmegaConf.to_container(other[k])
               if isinstance(first.get(k), DictConfig) else first.get(k) == other.get(k) for k in rest)


def key_combinations(key_values: dict[str, list[str]]) -> list[list[str]]:
    """The override lines of every combination of the swept keys' values other than all-first
    (key_values: each swept key's values after its first), so that values that clash only together
    (topk_blocks=4,12 with prompt_tokens=256,128) are refused before Hydra too; over
    MAX_JOBS_CHECKED, each value alone."""
    choices = [[None, *lines] for lines in key_values.values()]
    if math.prod(len(c) for c in choices) > MAX_JOBS_CHECKED:
        return [[line] for lines in key_values.values() for line in lines]
    return [[line for line in combination if line is not None]
            for combination in itertools.product(*choices) if any(line is not None for line in combination)]


def with_key_values(first_job: DictConfig, lines: list[str], loader: ConfigLoader) -> DictConfig:
    """first_job's config with the key overrides `lines` applied by Hydra's own rule (the config
    loader's; `+key=v`, already added in the first job, is set as `++key=v`): the job of swept
    keys' other values. A mapping value would merge into the first value's node rather than the
    config's own: refused, as prr's configs sweep scalars and lists."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    job = copy.deepcopy(first_job)
    for line in lines:
        (override,) = parse([line], loader)
        if isinstance(override.value(), dict):
            raise BadOverride(f"{line}: prr checks a sweep's jobs before running them and sweeps plain values and "
                              "lists, not mappings; set the mapping's keys one by one (key.a=1,2)")
        if override.is_add():
            (override,) = parse(["+" + line], loader)
        try:
            ConfigLoaderImpl._apply_overrides_to_config([override], job)
        except Exception as err:  # noqa: BLE001 - what Hydra would refuse when this job's turn came
            raise BadOverride(f"{line}: {one_line(err)}") from None
    return job


def check_group_option(loader: ConfigLoader, group: str, option: str, line: str, config_name: str,
                       searchpath: list[str]) -> None:
    # the options of every dir on the search path: conf/ and those of hydra.searchpath (the command
    # line's, else the primary config's)
    options = sorted(loader.get_group_options(group, config_name=config_name, overrides=searchpath))
    if option in options:
        return
    close = closest(option, options)
    hint = f"did you mean {close}? " if close else ""
    raise BadOverride(f"{line}: {group} has no option {option!r}; {hint}options: {', '.join(options)}")


def compose_job(config_name: str, job: list[str], groups: set[str]) -> DictConfig:
    try:
        return compose(config_name=config_name, overrides=job, return_hydra_config=True)
    except Exception as err:  # whatever composing raises (OmegaConf lets a ValueError through) is the overrides
        raise BadOverride(unknown_key(config_name, job, groups) or one_line(err)) from None


def unknown_key(config_name: str, job: list[str], groups: set[str]) -> str | None:
    """One line naming the first override of `job` that changes or deletes a key the config
    lacks, or None when every key it names exists (the failure is something else)."""
    parsed = OverridesParser.create().parse_overrides(job)

    def adds(o: Override) -> bool:  # chooses a group option, adds a key or a config dir: composed first, as given
        return o.key_or_group in groups or o.is_add() or o.is_force_add() or o.get_key_element() == SEARCHPATH

    try:
        cfg = compose(config_name=config_name, overrides=[o.input_line for o in parsed if adds(o)],
                      return_hydra_config=True)
    except Exception:
        return None  # the group options or added keys themselves fail: Hydra's message says why
    tree = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(tree, dict)
    choices = tree["hydra"]["runtime"]["choices"]
    for override in parsed:
        if adds(override):
            continue
        problem = missing_key(tree, override, choices)
        if problem is not None:
            return f"{override.input_line}: {problem}"
    return None


def missing_key(tree: dict[str, Any], override: Override, choices: dict[str, str]) -> str | None:
    """Why the key `override` changes or deletes is not in tree (the config as plain
    containers), or None when it is."""
    node: Any = tree
    parts = override.key_or_group.split(".")
    for depth, part in enumerate(parts):
        if isinstance(node, list):
            if part.isdigit() and int(part) < len(node):
                node = node[int(part)]
                continue
            return f"{'.'.join(parts[:depth])} is the list {node!r}, which has no item {part!r}"
        if not isinstance(node, dict):
            return f"{'.'.join(parts[:depth])} is the value {node!r}, with no keys under it"
        if part in node:
            node = node[part]
            continue
        keys = sorted(k for k in node if not k.startswith("_"))
        where = ".".join(parts[:depth])
        elsewhere = key_elsewhere(tree, part, parts[0] if depth else None)
        close = closest(part, keys)
        hint = f"did you mean {where + '.' if where else ''}{close}? " if close else ""
        if depth <= 1 and elsewhere:  # the key of another group (selector.block_size: runtime.block_size)
            hint = f"did you mean {elsewhere}? "
        if not where:
            return f"the config has no key {part!r}; {hint}keys: {', '.join(keys)}"
        owner = f"{where} ({choices[where]})" if where in choices else where
        return f"{owner} has no key {part!r}; {hint}keys: {', '.join(keys)}"
    return None


def key_elsewhere(tree: dict[str, Any], key: str, group: str | None) -> str | None:
    """`<other group>.<key>` when another top-level node (not hydra's) has exactly this key."""
    for name, node in tree.items():
        if name not in (group, "hydra") and isinstance(node, dict) and key in node:
            return f"{name}.{key}"
    return None


def closest(name: str, names: list[str]) -> str | None:
    """The valid name meant by `name`, case aside: one containing it (topk -> topk_blocks), else the most similar."""
    folded = {n.casefold(): n for n in names}  # QUEST -> quest: case is the likeliest slip of all
    key = name.casefold()
    containing = [n for f, n in folded.items() if key in f]
    similar = difflib.get_close_matches(key, list(folded), n=1, cutoff=0.5)
    return (containing or [folded[s] for s in similar] or [None])[0]


def one_line(err: BaseException) -> str:
    """Hydra's message (and OmegaConf's beneath it, which Hydra prints too) on one line."""
    text = str(err)
    if isinstance(err.__cause__, OmegaConfBaseException):
        text += f" ({err.__cause__})"
    return " ".join(text.split())
