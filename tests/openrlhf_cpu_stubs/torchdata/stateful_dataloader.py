"""Stand-in: torch's DataLoader (OpenRLHF uses StatefulDataLoader for resumable data order)."""

from torch.utils.data import DataLoader as StatefulDataLoader  # noqa: F401
