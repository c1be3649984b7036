"""The local Kafka broker: KRaft nodes started from the project's own jars, one or a cluster.

Entry points: ``broker`` (start, stop and status of a node or a cluster; ``relaygr broker``'s
``broker_cli``), ``broker_files`` (its jars, fetched once by Maven from ``pom.xml``, its data and
state files), ``cluster`` (several nodes), and the secure broker's ``tls`` (a throwaway CA) and
``acls`` (``relaygr acl``'s ``acls_cli``).
"""
