//! ipvs mode's canary reads every ipset's entry count over netlink: against the real kernel's
//! ipset, in a throwaway network namespace (`kp_testbed::isolated`), the counts are the entries the
//! shell put there, over more sets than one netlink datagram carries.

use kp_dataplane::ipvs::{ExecIpset, IpsetRunner};
use kp_testbed::isolated::{self, sh};

#[test]
fn entry_counts_over_netlink_are_the_kernel_s() {
    isolated::run(
        "entry_counts_over_netlink_are_the_kernel_s",
        || isolated::missing(&["ipset"], &["true"]),
        || {
            // 400 sets (~100 bytes of header each: several datagrams), set i holding i % 7
            // entries, and one kind with port and address pairs.
            let mut input = String::new();
            for i in 0..400u32 {
                input.push_str(&format!("create KUBE-T{i} hash:ip\n"));
                for e in 0..i % 7 {
                    input.push_str(&format!("add KUBE-T{i} 10.0.{}.{e}\n", i % 250));
                }
            }
            input.push_str("create KUBE-PAIRS hash:ip,port,ip\n");
            input.push_str("add KUBE-PAIRS 10.96.0.1,tcp:80,10.244.0.1\n");
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("sets");
            std::fs::write(&path, input).expect("write");
            sh(&format!("ipset restore < '{}'", path.display()));

            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let counts = runtime
                .block_on(ExecIpset.entry_counts())
                .expect("the kernel answers");
            assert_eq!(counts.len(), 401, "{counts:?}");
            for i in 0..400u32 {
                let want = usize::try_from(i % 7).expect("small");
                assert_eq!(
                    counts.get(&format!("KUBE-T{i}")),
                    Some(&Some(want)),
                    "set {i}"
                );
            }
            assert_eq!(counts.get("KUBE-PAIRS"), Some(&Some(1)));

            sh("ipset flush KUBE-T6 && ipset destroy KUBE-T1");
            let counts = runtime
                .block_on(ExecIpset.entry_counts())
                .expect("the kernel answers");
            assert_eq!(counts.get("KUBE-T6"), Some(&Some(0)));
            assert_eq!(counts.get("KUBE-T1"), None);
        },
    );
}
