"""What a patch leaves on the objects it changes: the saved attributes that revert() restores,
and the name of the attribute a patched model keeps its patch record under. A leaf module:
patching.py and the TRL head's routing (integrations/trl.py) both use it."""

from __future__ import annotations

import dataclasses
from typing import Any

# A model's own patch record lives on the model (RECORD attribute): the record holds the model's
# modules, so keeping it anywhere else would keep every patched model alive forever.
RECORD = "_lmkernels_patch_record"


@dataclasses.dataclass
class Saved:
    obj: Any
    attr: str
    had_own: bool  # whether obj had attr in its own __dict__ (else it was inherited / absent)
    value: Any
    new: Any = None  # what replace() set

    @classmethod
    def replace(cls, obj: Any, attr: str, new: Any) -> Saved:
        own = vars(obj)
        saved = cls(obj, attr, attr in own, own.get(attr), new)
        setattr(obj, attr, new)
        return saved

    def replaced_since(self) -> bool:
        """Whether someone else has set the attribute since replace() (then theirs stays)."""
        return vars(self.obj).get(self.attr) is not self.new

    def restore(self) -> None:
        if self.had_own:
            setattr(self.obj, self.attr, self.value)
        else:
            delattr(self.obj, self.attr)


@dataclasses.dataclass
class SavedCell:
    """A closure cell replaced (TRL's fused head binds the forward it wraps in one): restore()
    puts the old value back unless someone replaced it since."""

    cell: Any
    value: Any
    new: Any

    @classmethod
    def replace(cls, cell: Any, new: Any) -> SavedCell:
        saved = cls(cell, cell.cell_contents, new)
        cell.cell_contents = new
        return saved

    def replaced_since(self) -> bool:
        return self.cell.cell_contents is not self.new

    def restore(self) -> None:
        if not self.replaced_since():
            self.cell.cell_contents = self.value
