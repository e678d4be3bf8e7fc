//! The size of an iptables-legacy (x_tables) table, read with one
//! `getsockopt(IPT_SO_GET_INFO)`: how many rules it holds, how many bytes they take and
//! where each built-in chain starts. Reading any rule of a legacy table copies all of them
//! (tens of megabytes for nat at 10k services), so a check that runs every few seconds
//! compares this instead and reads the rules only when it changed.
//!
//! The kernel answers for the caller's network namespace. Only for legacy tables: on a host
//! whose iptables writes to nf_tables, asking would load `ip_tables` and create an empty
//! legacy table, which the tools then warn about.

mod getinfo;

pub use getinfo::{Family, TableInfo, table_info};
