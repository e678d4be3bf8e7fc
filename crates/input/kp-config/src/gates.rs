//! The feature gates upstream kube-proxy knows, for refusing the ones it does not.
//!
//! Upstream's binary registers every Kubernetes gate (kube's own, the generic API server's,
//! client-go's, component-base's logging and z-pages gates, `AllAlpha`, `AllBeta`) in one
//! registry, and `featureGates` (file or `--feature-gates`) may name any of them; a name not
//! registered fails start-up with "unrecognized feature gate: NAME", and a gate locked to its
//! default (GA or deprecated and no longer switchable) set the other way fails with "cannot
//! set feature gate NAME to VALUE, feature is locked to DEFAULT" (component-base's
//! `featuregate`). Gates removed upstream after graduating (e.g. `TopologyAwareHints`) are
//! unknown.
//!
//! [`UPSTREAM_GATES`] is upstream's registry at the newest release (Kubernetes 1.36), taken
//! from `test/compatibility_lifecycle/reference/versioned_feature_list.yaml` of the Kubernetes
//! source as of the 1.37 development cycle (each gate's newest spec at or before 1.36; gates
//! first listed for 1.37 left out; a gate removed during 1.37 development would be missing)
//! plus client-go's `features/known_features.go` at v0.36.0 and component-base's two special
//! gates. It lists every gate the compatibility tooling sees, a few of which upstream
//! kube-proxy does not register (cloud-provider's): those are accepted here and refused there.
//! Update it with each upstream minor release.
//!
//! Ahead of that update, the gates kube-proxy itself gained in 1.37 are listed too
//! ([`GATES_1_37`]): `KubeProxyIPVS` (GA, default true; KEP-5495, kubernetes#139397),
//! `NFTablesNetlink` (beta) and `KubeProxyNFTablesLocalhostNodePorts` (alpha, default false;
//! beta, default true, from 1.38; KEP-6032). A 1.37 DaemonSet that sets them must start.

/// Whether upstream lets a gate be switched at the newest release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamGate {
    /// Settable either way.
    Settable,
    /// Locked to this default: setting the other value is refused.
    LockedTo(bool),
}

use UpstreamGate::{LockedTo, Settable};

/// Every feature gate upstream kube-proxy's registry holds at the newest release, by name.
pub const UPSTREAM_GATES: &[(&str, UpstreamGate)] = &[
    ("AggregatedDiscoveryRemoveBetaType", LockedTo(true)),
    ("AllAlpha", Settable),
    ("AllBeta", Settable),
    ("AllowDNSOnlyNodeCSR", Settable),
    ("AllowInsecureKubeletCertificateSigningRequests", Settable),
    (
        "AllowOverwriteTerminationGracePeriodSeconds",
        LockedTo(false),
    ),
    ("AllowParsingUserUIDFromCertAuth", Settable),
    ("AllowServiceExternalIPs", Settable),
    ("AllowUnsafeMalformedObjectDeletion", Settable),
    ("AnonymousAuthConfigurableEndpoints", LockedTo(true)),
    ("AnyVolumeDataSource", LockedTo(true)),
    ("APIResponseCompression", Settable),
    ("APIServerIdentity", Settable),
    ("APIServerTracing", LockedTo(true)),
    ("APIServingWithRoutine", Settable),
    ("AtomicFIFO", Settable),
    ("AuthorizeNodeWithSelectors", LockedTo(true)),
    ("AuthorizePodWebsocketUpgradeCreatePermission", Settable),
    ("AuthorizeWithSelectors", LockedTo(true)),
    ("BtreeWatchCache", LockedTo(true)),
    ("CBORServingAndStorage", Settable),
    ("ChangeContainerStatusOnKubeletRestart", Settable),
    ("ClearingNominatedNodeNameAfterBinding", Settable),
    ("ClientsAllowCARotation", Settable),
    ("ClientsAllowCBOR", Settable),
    ("ClientsAllowTLSCacheGC", Settable),
    ("ClientsPreferCBOR", Settable),
    (
        "CloudControllerManagerWatchBasedRoutesReconciliation",
        Settable,
    ),
    ("CloudControllerManagerWebhook", Settable),
    ("ClusterTrustBundle", Settable),
    ("ClusterTrustBundleProjection", Settable),
    ("ComponentFlagz", Settable),
    ("ComponentStatusz", Settable),
    ("ConcurrentWatchObjectDecode", Settable),
    ("ConsistentListFromCache", LockedTo(true)),
    ("ConstrainedImpersonation", Settable),
    ("ContainerCheckpoint", Settable),
    ("ContainerRestartRules", Settable),
    ("ContainerStopSignals", Settable),
    ("ContextualLogging", Settable),
    ("ControllerManagerReleaseLeaderElectionLockOnExit", Settable),
    ("CoordinatedLeaderElection", Settable),
    ("CPUCFSQuotaPeriod", Settable),
    ("CPUManagerPolicyAlphaOptions", Settable),
    ("CPUManagerPolicyBetaOptions", Settable),
    ("CPUManagerPolicyOptions", LockedTo(true)),
    ("CRDObservedGenerationTracking", Settable),
    ("CRDValidationRatcheting", LockedTo(true)),
    ("CRIListStreaming", Settable),
    ("CrossNamespaceVolumeDataSource", Settable),
    ("CSIServiceAccountTokenSecrets", LockedTo(true)),
    ("CSIVolumeHealth", Settable),
    ("CustomResourceFieldSelectors", LockedTo(true)),
    ("DeclarativeValidation", LockedTo(true)),
    ("DeclarativeValidationBeta", Settable),
    ("DeclarativeValidationTakeover", Settable),
    ("DeploymentReplicaSetTerminatingReplicas", Settable),
    ("DetectCacheInconsistency", Settable),
    ("DisableAllocatorDualWrite", LockedTo(true)),
    ("DisableCPUQuotaWithExclusiveCPUs", Settable),
    ("DisableNodeKubeProxyVersion", LockedTo(true)),
    ("DRAAdminAccess", LockedTo(true)),
    ("DRAConsumableCapacity", Settable),
    ("DRADeviceBindingConditions", Settable),
    ("DRADeviceTaintRules", Settable),
    ("DRADeviceTaints", Settable),
    ("DRAExtendedResource", Settable),
    ("DRAListTypeAttributes", Settable),
    ("DRANodeAllocatableResources", Settable),
    ("DRAPartitionableDevices", Settable),
    ("DRAPrioritizedList", Settable),
    ("DRAResourceClaimDeviceStatus", Settable),
    ("DRAResourceClaimGranularStatusAuthorization", Settable),
    ("DRAResourcePoolStatus", Settable),
    ("DRASchedulerFilterTimeout", Settable),
    ("DRAWorkloadResourceClaims", Settable),
    ("DynamicResourceAllocation", LockedTo(true)),
    ("EnvFiles", Settable),
    ("EventedPLEG", Settable),
    ("ExecProbeTimeout", LockedTo(true)),
    ("ExtendWebSocketsToKubelet", Settable),
    ("ExternalServiceAccountTokenSigner", LockedTo(true)),
    ("GangScheduling", Settable),
    ("GenericWorkload", Settable),
    ("GitRepoVolumeDriver", LockedTo(false)),
    ("GracefulNodeShutdown", Settable),
    ("GracefulNodeShutdownBasedOnPodPriority", Settable),
    ("HostnameOverride", Settable),
    ("HPAConfigurableTolerance", Settable),
    ("HPAScaleToZero", Settable),
    ("ImageMaximumGCAge", LockedTo(true)),
    ("ImageVolume", LockedTo(true)),
    ("ImageVolumeWithDigest", Settable),
    ("InformerResourceVersion", Settable),
    ("InOrderInformers", LockedTo(true)),
    ("InOrderInformersBatchProcess", Settable),
    ("InPlacePodLevelResourcesVerticalScaling", Settable),
    ("InPlacePodVerticalScaling", LockedTo(true)),
    ("InPlacePodVerticalScalingExclusiveCPUs", Settable),
    ("InPlacePodVerticalScalingExclusiveMemory", Settable),
    ("InPlacePodVerticalScalingInitContainers", Settable),
    ("JobBackoffLimitPerIndex", LockedTo(true)),
    ("JobManagedBy", LockedTo(true)),
    ("JobPodReplacementPolicy", LockedTo(true)),
    ("JobSuccessPolicy", LockedTo(true)),
    ("KMSv1", Settable),
    ("KubeletCgroupDriverFromCRI", LockedTo(true)),
    ("KubeletCrashLoopBackOffMax", Settable),
    ("KubeletEnsureSecretPulledImages", Settable),
    ("KubeletFineGrainedAuthz", LockedTo(true)),
    ("KubeletInUserNamespace", Settable),
    ("KubeletPodResourcesDynamicResources", LockedTo(true)),
    ("KubeletPodResourcesGet", LockedTo(true)),
    ("KubeletPodResourcesListUseActivePods", Settable),
    ("KubeletPSI", LockedTo(true)),
    ("KubeletRegistrationGetOnExistsOnly", Settable),
    ("KubeletSeparateDiskGC", Settable),
    ("KubeletServiceAccountTokenForCredentialProviders", Settable),
    ("KubeletTracing", LockedTo(true)),
    // 1.37 (see GATES_1_37).
    ("KubeProxyIPVS", Settable),
    // 1.37 (see GATES_1_37).
    ("KubeProxyNFTablesLocalhostNodePorts", Settable),
    ("ListFromCacheSnapshot", Settable),
    ("LocalStorageCapacityIsolationFSQuotaMonitoring", Settable),
    ("LogarithmicScaleDown", LockedTo(true)),
    ("LoggingAlphaOptions", Settable),
    ("LoggingBetaOptions", Settable),
    ("ManifestBasedAdmissionControlConfig", Settable),
    ("MatchLabelKeysInPodAffinity", LockedTo(true)),
    ("MatchLabelKeysInPodTopologySpread", Settable),
    ("MatchLabelKeysInPodTopologySpreadSelectorMerge", Settable),
    ("MaxUnavailableStatefulSet", Settable),
    ("MemoryQoS", Settable),
    ("MultiCIDRServiceAllocator", LockedTo(true)),
    ("MutableCSINodeAllocatableCount", LockedTo(true)),
    ("MutablePodResourcesForSuspendedJobs", Settable),
    ("MutablePVNodeAffinity", Settable),
    ("MutableSchedulingDirectivesForSuspendedJobs", Settable),
    ("MutatingAdmissionPolicy", Settable),
    ("NativeHistograms", Settable),
    // 1.37 (see GATES_1_37).
    ("NFTablesNetlink", Settable),
    ("NFTablesProxyMode", LockedTo(true)),
    ("NodeDeclaredFeatures", Settable),
    ("NodeInclusionPolicyInPodTopologySpread", LockedTo(true)),
    ("NodeLogQuery", LockedTo(true)),
    ("NodeSwap", LockedTo(true)),
    ("NominatedNodeNameForExpectation", Settable),
    ("OpenAPIEnums", Settable),
    ("OpportunisticBatching", Settable),
    ("OrderedNamespaceDeletion", LockedTo(true)),
    ("PersistentVolumeClaimUnusedSinceTime", Settable),
    ("PLEGOnDemandRelist", Settable),
    ("PodAndContainerStatsFromCRI", Settable),
    ("PodCertificateRequest", Settable),
    ("PodDeletionCost", Settable),
    ("PodLevelResourceManagers", Settable),
    ("PodLevelResources", Settable),
    ("PodLifecycleSleepAction", LockedTo(true)),
    ("PodLifecycleSleepActionAllowZero", LockedTo(true)),
    ("PodLogsQuerySplitStreams", Settable),
    ("PodObservedGenerationTracking", LockedTo(true)),
    ("PodReadyToStartContainersCondition", Settable),
    ("PodsAPI", Settable),
    ("PodSchedulingReadiness", LockedTo(true)),
    ("PodTopologyLabelsAdmission", Settable),
    ("PortForwardWebsockets", Settable),
    ("PreferSameTrafficDistribution", LockedTo(true)),
    ("PreventStaticPodAPIReferences", Settable),
    ("ProcMountType", LockedTo(true)),
    ("QOSReserved", Settable),
    ("RecoverVolumeExpansionFailure", LockedTo(true)),
    ("RecursiveReadOnlyMounts", LockedTo(true)),
    ("ReduceDefaultCrashLoopBackOffDecay", Settable),
    ("RelaxedDNSSearchValidation", LockedTo(true)),
    ("RelaxedEnvironmentVariableValidation", LockedTo(true)),
    ("RelaxedServiceNameValidation", Settable),
    ("ReloadKubeletClientCAFile", Settable),
    ("ReloadKubeletServerCertificateFile", Settable),
    ("RemoteRequestHeaderUID", Settable),
    ("ResilientWatchCacheInitialization", LockedTo(true)),
    ("ResourceHealthStatus", Settable),
    ("ResourceHealthStatusMessage", Settable),
    ("RestartAllContainersOnContainerExits", Settable),
    ("RetryGenerateName", LockedTo(true)),
    ("RotateKubeletServerCertificate", Settable),
    ("RuntimeClassInImageCriAPI", Settable),
    ("SchedulerAsyncAPICalls", Settable),
    ("SchedulerAsyncPreemption", Settable),
    ("SchedulerPopFromBackoffQ", Settable),
    ("SchedulerQueueingHints", LockedTo(true)),
    ("SELinuxChangePolicy", LockedTo(true)),
    ("SELinuxMount", Settable),
    ("SELinuxMountReadWriteOncePod", LockedTo(true)),
    ("SeparateCacheWatchRPC", LockedTo(false)),
    ("SeparateTaintEvictionController", LockedTo(true)),
    ("ServiceAccountNodeAudienceRestriction", Settable),
    ("ServiceAccountTokenJTI", LockedTo(true)),
    ("ServiceAccountTokenNodeBinding", LockedTo(true)),
    ("ServiceAccountTokenNodeBindingValidation", LockedTo(true)),
    ("ServiceAccountTokenPodNodeInfo", LockedTo(true)),
    ("ServiceCIDRStatusFieldWiping", Settable),
    ("ShardedListAndWatch", Settable),
    ("SidecarContainers", LockedTo(true)),
    ("SizeBasedListCostEstimate", Settable),
    ("StaleControllerConsistencyDaemonSet", Settable),
    ("StaleControllerConsistencyJob", Settable),
    ("StaleControllerConsistencyReplicaSet", Settable),
    ("StaleControllerConsistencyStatefulSet", Settable),
    ("StatefulSetSemanticRevisionComparison", Settable),
    ("StorageCapacityScoring", Settable),
    ("StorageNamespaceIndex", Settable),
    ("StorageVersionAPI", Settable),
    ("StorageVersionHash", Settable),
    ("StorageVersionMigrator", Settable),
    ("StreamingCollectionEncodingToJSON", LockedTo(true)),
    ("StreamingCollectionEncodingToProtobuf", LockedTo(true)),
    ("StrictIPCIDRValidation", Settable),
    ("StructuredAuthenticationConfiguration", LockedTo(true)),
    (
        "StructuredAuthenticationConfigurationEgressSelector",
        Settable,
    ),
    ("StructuredAuthenticationConfigurationJWKSMetrics", Settable),
    ("SupplementalGroupsPolicy", LockedTo(true)),
    ("SystemdWatchdog", LockedTo(true)),
    ("TaintTolerationComparisonOperators", Settable),
    ("TokenRequestServiceAccountUIDValidation", Settable),
    ("TopologyAwareWorkloadScheduling", Settable),
    ("TopologyManagerPolicyAlphaOptions", Settable),
    ("TopologyManagerPolicyBetaOptions", Settable),
    ("TopologyManagerPolicyOptions", LockedTo(true)),
    ("TranslateStreamCloseWebsocketRequests", Settable),
    ("UnauthenticatedHTTP2DOSMitigation", Settable),
    ("UnknownVersionInteroperabilityProxy", Settable),
    ("UnlockWhileProcessingFIFO", Settable),
    ("UserNamespacesHostNetworkSupport", Settable),
    ("UserNamespacesSupport", LockedTo(true)),
    ("VolumeAttributesClass", LockedTo(true)),
    ("VolumeLimitScaling", Settable),
    ("WatchCacheInitializationPostStartHook", Settable),
    ("WatchList", Settable),
    ("WatchListClient", Settable),
    ("WindowsCPUAndMemoryAffinity", Settable),
    ("WindowsGracefulNodeShutdown", Settable),
    ("WindowsHostNetwork", Settable),
    ("WinDSR", LockedTo(true)),
    ("WinOverlay", LockedTo(true)),
    ("WorkloadAwarePreemption", Settable),
    ("WorkloadWithJob", Settable),
];

/// The kube-proxy gates of upstream 1.37 that [`UPSTREAM_GATES`] holds ahead of its update
/// to that release.
pub const GATES_1_37: [&str; 3] = [
    "KubeProxyIPVS",
    "NFTablesNetlink",
    LOCALHOST_NODE_PORTS_GATE,
];

/// Localhost NodePorts in nftables mode through a userspace listener (KEP-6032): alpha in
/// 1.37, so off unless set (beta and on by default from 1.38, when it joins [`DEFAULT_ON`]).
pub const LOCALHOST_NODE_PORTS_GATE: &str = "KubeProxyNFTablesLocalhostNodePorts";

/// Whether a gate is on: its setting in `gates`, else upstream's default. Only the gates
/// this project acts on have a default here ([`DEFAULT_ON`]); any other unset gate is off.
pub fn enabled(gates: &std::collections::BTreeMap<String, bool>, name: &str) -> bool {
    gates
        .get(name)
        .copied()
        .unwrap_or_else(|| DEFAULT_ON.contains(&name))
}

/// The gates this project acts on whose upstream default is true.
pub const DEFAULT_ON: [&str; 4] = [
    "KubeProxyIPVS",
    "AllowServiceExternalIPs",
    // Beta in 1.36 (KEP-4827, KEP-4828).
    "ComponentStatusz",
    "ComponentFlagz",
];

/// How upstream judges `name` set to `value`: `None` when accepted, else its error message.
pub fn upstream_refusal(name: &str, value: bool) -> Option<String> {
    match UPSTREAM_GATES.iter().find(|(known, _)| *known == name) {
        None => Some(format!("unrecognized feature gate: {name}")),
        Some((_, LockedTo(default))) if *default != value => Some(format!(
            "cannot set feature gate {name} to {value}, feature is locked to {default}"
        )),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_and_locked_gates_get_upstreams_messages() {
        assert_eq!(
            upstream_refusal("NoSuchGate", true).as_deref(),
            Some("unrecognized feature gate: NoSuchGate")
        );
        // Removed upstream after graduating: not in the registry any more.
        assert!(upstream_refusal("TopologyAwareHints", true).is_some());
        assert_eq!(
            upstream_refusal("NFTablesProxyMode", false).as_deref(),
            Some("cannot set feature gate NFTablesProxyMode to false, feature is locked to true")
        );
        assert_eq!(upstream_refusal("NFTablesProxyMode", true), None);
        assert_eq!(upstream_refusal("GracefulNodeShutdown", false), None);
        assert_eq!(upstream_refusal("AllAlpha", true), None);
        // Names are case-sensitive upstream too.
        assert!(upstream_refusal("nftablesproxymode", true).is_some());
    }

    #[test]
    fn the_gates_of_1_37_are_accepted_both_ways() {
        for name in GATES_1_37 {
            assert_eq!(upstream_refusal(name, true), None, "{name}");
            assert_eq!(upstream_refusal(name, false), None, "{name}");
        }
    }

    #[test]
    fn unset_gates_take_upstreams_default() {
        let mut gates = std::collections::BTreeMap::new();
        assert!(enabled(&gates, "KubeProxyIPVS"));
        assert!(enabled(&gates, "AllowServiceExternalIPs"));
        assert!(!enabled(&gates, "NFTablesNetlink"));
        assert!(!enabled(&gates, LOCALHOST_NODE_PORTS_GATE));
        gates.insert("KubeProxyIPVS".to_owned(), false);
        gates.insert("NFTablesNetlink".to_owned(), true);
        assert!(!enabled(&gates, "KubeProxyIPVS"));
        assert!(enabled(&gates, "NFTablesNetlink"));
    }

    #[test]
    fn the_table_has_each_gate_once() {
        let mut names: Vec<&str> = UPSTREAM_GATES.iter().map(|(n, _)| *n).collect();
        let len = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), len);
    }
}
