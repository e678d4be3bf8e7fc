//! The verdict-free layout's backend over the fake I/O.
