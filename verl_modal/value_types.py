"""The value-type check of a verl line: an override whose key has a number or boolean default in
verl's config must compose to one (``rollout.n=two`` would otherwise surface as a formatting
error deep in verl's validation)."""

from __future__ import annotations

from verl_modal.preflight import VerlPreflightError, compose, explicit_values


def _kind(value) -> str | None:
    """What kind of value verl's default is, for the type check; None: anything goes."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    return None


# Keys whose default in verl's config is null (``null``: "derive it") but whose value, when
# given, verl uses as a number: a word there would pass the default-based check above.
NULL_DEFAULT_KINDS = {
    "trainer.total_training_steps": "an integer",
    "data.val_batch_size": "an integer",
}


def _fits(value, kind: str) -> bool:
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "an integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, int | float) and not isinstance(value, bool)


def value_type_check(user_overrides: list[str]):
    """A preflight check: each of the user's overrides whose key has a number or boolean
    default in verl's config must compose to one (``rollout.n=two`` would otherwise surface
    as a formatting error deep in verl's validation)."""

    def check(config) -> None:
        from omegaconf import OmegaConf

        # Only a value that composed to a string can be a misplaced word; the defaults cost a
        # second compose (about a second), so they are read only then.
        keys = [
            k
            for k in explicit_values(user_overrides)
            if isinstance(OmegaConf.select(config, k, default=None, throw_on_missing=False), str)
        ]
        if not keys:
            return
        defaults = compose([])
        for key in keys:
            default = OmegaConf.select(defaults, key, default=None, throw_on_missing=False)
            kind = _kind(default) or (NULL_DEFAULT_KINDS.get(key) if default is None else None)
            got = OmegaConf.select(config, key, default=None, throw_on_missing=False)
            if kind is None or got is None or _fits(got, kind):
                continue
            raise VerlPreflightError(
                f"{key}={got}: verl expects {kind} there (its default is {'null' if default is None else default}); fix the value"
            )

    return check
