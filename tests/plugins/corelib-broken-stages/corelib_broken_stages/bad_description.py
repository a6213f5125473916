"""A stage description with a slot that does not exist: reported, never used."""

from pydantic import BaseModel

import corelib


class Args(BaseModel):
    level: int = 1


@corelib.hookimpl
def corelib_stages():
    return [corelib.StageSpec(name="misplaced", slot="after_step_3", args=Args, apply=lambda x, inputs: x)]
