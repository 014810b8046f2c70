//! census operator
