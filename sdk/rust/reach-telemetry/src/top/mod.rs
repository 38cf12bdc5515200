//! `reach top`.
