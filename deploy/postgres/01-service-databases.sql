-- Runs once, when the postgres container initialises an empty data volume
-- (docker-compose.yml mounts this folder at /docker-entrypoint-initdb.d).
--
-- Each service owns its own database, reached through its own login role; no role can connect
-- to another service's database. The passwords are for local development only.
-- "order" is a reserved word, hence the quotes.
--
-- The *_cluster_db databases belong to the cluster profile's copies of the services
-- (order-cluster, ...), owned by the same roles: the copies run beside the default ones, and
-- two relays of one outbox publishing to two different brokers would split its events.

CREATE ROLE "order" LOGIN PASSWORD 'order';
CREATE DATABASE order_db OWNER "order";
REVOKE ALL ON DATABASE order_db FROM PUBLIC;
CREATE DATABASE order_cluster_db OWNER "order";
REVOKE ALL ON DATABASE order_cluster_db FROM PUBLIC;

CREATE ROLE invoicing LOGIN PASSWORD 'invoicing';
CREATE DATABASE invoicing_db OWNER invoicing;
REVOKE ALL ON DATABASE invoicing_db FROM PUBLIC;
CREATE DATABASE invoicing_cluster_db OWNER invoicing;
REVOKE ALL ON DATABASE invoicing_cluster_db FROM PUBLIC;

CREATE ROLE notification LOGIN PASSWORD 'notification';
CREATE DATABASE notification_db OWNER notification;
REVOKE ALL ON DATABASE notification_db FROM PUBLIC;
CREATE DATABASE notification_cluster_db OWNER notification;
REVOKE ALL ON DATABASE notification_cluster_db FROM PUBLIC;
