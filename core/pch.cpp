// Translation unit that owns the precompiled header (see cmake/Parallax.cmake).
