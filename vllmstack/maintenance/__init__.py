"""The upkeep loop a maintainer runs on a Monday: what upstream released, whether the local
patches and the profiles' argv survive it (`updates`), and whether a chat template keeps the
properties the stack relies on (`templates`)."""
