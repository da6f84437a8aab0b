"""Fake of Intel Gaudi`s habana_frameworks package (tests only).

Like the real bridge, it reads PT_HPU_RECIPE_CACHE_CONFIG once, when it is first imported: a setting
made later has no effect on where compiled recipes go."""

import os

RECIPE_CACHE_CONFIG_AT_IMPORT = os.environ.get("PT_HPU_RECIPE_CACHE_CONFIG")
