"""A well-described stage whose implementation raises at every step."""

from pydantic import BaseModel

import corelib


class Args(BaseModel):
    strength: float = 1.0


def explode(x, inputs):
    raise RuntimeError("device fell over")


@corelib.hookimpl
def corelib_stages():
    return [corelib.StageSpec(name="explodes", slot="after_filters", args=Args, apply=explode,
                              description="test plugin: its apply always raises")]
