//! Tool names ↔ capability names (built next).
