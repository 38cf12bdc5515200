//! Reach's protocol edges.
pub mod a2a;
